#!/usr/bin/env bash
# A pool of encoders on one machine sharing one embedding cache through Mooncake Store: a mooncake_master,
# a mooncake_client that lends the pool STORE_MEMORY (entries there outlive every encoder's restart), and one
# encode-server per GPU (or N on the CPU), each on its own port, all with --cache-store. Needs the mooncake
# extra (pip install mooncake-transfer-engine-non-cuda; the binaries load libibverbs: apt-get install libibverbs1).
# Usage: MODEL=/models/Qwen2.5-VL-7B-Instruct bash scripts/store_pool.sh      (one server per GPU)
#        N=3 DEVICE=cpu bash scripts/store_pool.sh --cache-bytes 256MiB      (extra arguments: every server)
# Ctrl-C stops them all.
set -euo pipefail
MASTER_PORT="${MASTER_PORT:-50051}"
BASE_PORT="${BASE_PORT:-30000}"
STORE_MEMORY="${STORE_MEMORY:-4GB}"
DEVICE="${DEVICE:-cuda}"
if [ "$DEVICE" = cuda ]; then N="${N:-$(nvidia-smi -L | wc -l)}"; else N="${N:-2}"; fi
BIN="$(python3 -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
"$BIN/mooncake_master" --rpc_port="$MASTER_PORT" --rpc_address=127.0.0.1 --metrics_host=127.0.0.1 \
  --enable_metric_reporting=false &
pids+=($!)
sleep 1
"$BIN/mooncake_client" --master_server_address="127.0.0.1:$MASTER_PORT" --metadata_server=P2PHANDSHAKE \
  --global_segment_size="$STORE_MEMORY" --protocol=tcp --host=127.0.0.1 &
pids+=($!)
for i in $(seq 0 $((N - 1))); do
  device="$DEVICE"; [ "$DEVICE" = cuda ] && device="cuda:$i"
  encode-server --model "${MODEL:-tiny-qwen2.5-vl}" --device "$device" --host 127.0.0.1 --port $((BASE_PORT + i)) \
    --cache-store "mooncake://127.0.0.1:$MASTER_PORT" --cache-store-global-segment-size 0 "$@" &
  pids+=($!)
done
echo "encoders on 127.0.0.1:$BASE_PORT..$((BASE_PORT + N - 1)), Mooncake master on 127.0.0.1:$MASTER_PORT"
wait -n
