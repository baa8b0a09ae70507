#!/usr/bin/env bash
# A pool of encoders on one machine sharing one embedding cache through Mooncake Store: a mooncake_master,
# a mooncake_client that lends the pool STORE_MEMORY (entries there outlive every encoder's restart), and one
# encode-server per GPU (or N on the CPU), each on its own port, all with --cache-store. Needs the mooncake
# extra (pip install mooncake-transfer-engine-non-cuda; the binaries load libibverbs: apt-get install libibverbs1).
# Usage: MODEL=/models/Qwen2.5-VL-7B-Instruct bash scripts/store_pool.sh      (one server per GPU)
#        N=3 DEVICE=cpu bash scripts/store_pool.sh --cache-bytes 256MiB      (extra arguments: every server)
# Without DEVICE, the pool runs one encoder per GPU that nvidia-smi lists, or N (default 2) on the CPU where
# there is none. Every line a process prints starts with its name and port. The pool is announced once every
# encoder answers /health. Ctrl-C stops them all.
set -euo pipefail
MASTER_PORT="${MASTER_PORT:-50051}"
BASE_PORT="${BASE_PORT:-30000}"
STORE_MEMORY="${STORE_MEMORY:-4GB}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-600}"
say() { echo "store_pool: $*" >&2; }

gpus=0
command -v nvidia-smi >/dev/null && gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
if [ -z "${DEVICE:-}" ]; then
  if [ "$gpus" -gt 0 ]; then DEVICE=cuda; else
    DEVICE=cpu
    say "no GPU found (nvidia-smi is not on PATH or lists none): ${N:-2} encoders on the CPU (set N to change it)"
  fi
fi
if [ "$DEVICE" = cuda ]; then
  [ "$gpus" -gt 0 ] || { say "DEVICE=cuda but nvidia-smi lists no GPU: run with DEVICE=cpu (and N=...)"; exit 2; }
  N="${N:-$gpus}"
else
  N="${N:-2}"
fi
if ! BIN="$(python3 -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))' 2>/dev/null)" \
    || ! python3 -c 'import mooncake.store' 2>/dev/null; then
  say "Mooncake cannot be imported by $(command -v python3): pip install -e '.[mooncake]'; its binaries also need" \
      "the system's libibverbs1 (apt-get install libibverbs1). Python's own message:"
  python3 -c 'import mooncake.store' || true
  exit 2
fi

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
# Each process's lines get its name and port in front (the process substitution keeps $! the process's own pid).
"$BIN/mooncake_master" --rpc_port="$MASTER_PORT" --rpc_address=127.0.0.1 --metrics_host=127.0.0.1 \
  --enable_metric_reporting=false > >(sed -u "s/^/[mooncake_master :$MASTER_PORT] /") 2>&1 &
pids+=($!)
sleep 1
"$BIN/mooncake_client" --master_server_address="127.0.0.1:$MASTER_PORT" --metadata_server=P2PHANDSHAKE \
  --global_segment_size="$STORE_MEMORY" --protocol=tcp --host=127.0.0.1 > >(sed -u "s/^/[mooncake_client] /") 2>&1 &
pids+=($!)
encoders=()
for i in $(seq 0 $((N - 1))); do
  device="$DEVICE"; [ "$DEVICE" = cuda ] && device="cuda:$i"
  port=$((BASE_PORT + i))
  encode-server --model "${MODEL:-tiny-qwen2.5-vl}" --device "$device" --host 127.0.0.1 --port "$port" \
    --cache-store "mooncake://127.0.0.1:$MASTER_PORT" --cache-store-global-segment-size 0 "$@" \
    > >(sed -u "s/^/[encoder :$port] /") 2>&1 &
  pids+=($!)
  encoders+=("$!:$port")
done
say "starting $N encoders on $DEVICE; waiting until each answers /health (at most ${READY_TIMEOUT_S} s)"
deadline=$((SECONDS + READY_TIMEOUT_S))
for entry in "${encoders[@]}"; do
  pid=${entry%%:*} port=${entry##*:}
  until curl -sf -o /dev/null "http://127.0.0.1:$port/health"; do
    kill -0 "$pid" 2>/dev/null || { say "the encoder on port $port exited before it was ready (its lines above)"; exit 1; }
    [ "$SECONDS" -lt "$deadline" ] || { say "the encoder on port $port was not ready within ${READY_TIMEOUT_S} s"; exit 1; }
    sleep 1
  done
done
say "ready: encoders on 127.0.0.1:$BASE_PORT..$((BASE_PORT + N - 1)), Mooncake master on 127.0.0.1:$MASTER_PORT"
wait -n
