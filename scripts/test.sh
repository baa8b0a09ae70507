#!/usr/bin/env bash
# Run the tests. The first run sets up .venv (torch 2.14.1 and torchvision 0.29.1 pinned first: the
# processors transformers picks on GPU machines are the ones tested; they run on the CPU too), then this
# package with its test extra; later runs only check .venv (no pip, no network) until pyproject.toml
# changes (scripts/venv.sh). Extra arguments go to pytest: `bash scripts/test.sh -m quick` for the quick
# tier, `-m slow` for the long benchmarks and soaks (run serially).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv test
exec "$VENV/bin/python" -m pytest "$@"
