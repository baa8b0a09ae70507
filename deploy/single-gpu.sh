#!/usr/bin/env bash
# One encoder on one GPU: bfloat16 on cuda:0, listening on all interfaces for the router.
# Usage: MODEL=/models/Qwen2.5-VL-7B-Instruct ./single-gpu.sh   (any flag can also come from ENCODER_* variables)
set -euo pipefail
exec encode-server --model "${MODEL:?set MODEL to a checkpoint folder}" --device cuda --dtype bfloat16 \
  --host "${HOST:-0.0.0.0}" --port "${PORT:-30000}" --max-batch-size "${MAX_BATCH_SIZE:-32}" "$@"
