#!/usr/bin/env bash
# One encoder split over TP GPUs of one node (TP = 2, 4 or 8): rank 0 serves HTTP and starts ranks 1..TP-1
# itself, one per GPU (cuda:0..cuda:TP-1), joined with NCCL. The vision tower's heads must divide by TP.
# Usage: MODEL=/models/InternVL3-38B-hf TP=4 ./tensor-parallel.sh
set -euo pipefail
TP="${TP:-2}"
case "$TP" in 2|4|8) ;; *) echo "TP must be 2, 4 or 8" >&2; exit 2;; esac
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((TP - 1)))}"
exec encode-server --model "${MODEL:?set MODEL}" --device cuda --dtype bfloat16 --tp-size "$TP" \
  --host "${HOST:-0.0.0.0}" --port "${PORT:-30000}" "$@"
