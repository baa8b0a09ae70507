#!/usr/bin/env bash
# N whole replicas of the encoder, one per GPU of this node, behind one HTTP endpoint: rank 0 hands each
# batch to the least-loaded replica and drops dead ones from the rotation (/server_info shows them).
# Usage: MODEL=/models/Qwen2-Audio-7B-Instruct DP=8 ./data-parallel.sh
set -euo pipefail
DP="${DP:-$(nvidia-smi -L | wc -l)}"
exec encode-server --model "${MODEL:?set MODEL}" --device cuda --dtype bfloat16 --dp-size "$DP" \
  --host "${HOST:-0.0.0.0}" --port "${PORT:-30000}" "$@"
