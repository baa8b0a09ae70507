#!/usr/bin/env bash
# Start the server (on the built-in model unless --model says otherwise). The first run sets up .venv: torch
# 2.14.1 and torchvision 0.29.1 pinned first (they run on the CPU too), then this package; later runs only
# check .venv (no pip, no network) and start at once, until pyproject.toml changes (scripts/venv.sh).
# Without a GPU, the smaller CPU build of torch: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/serve.sh
# Extra arguments go to encode-server, e.g. `bash scripts/serve.sh --port 30001 --max-wait-ms 5`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv
exec "$VENV/bin/encode-server" "$@"
