#!/usr/bin/env bash
# Set up .venv (torch 2.14.1 and torchvision 0.29.1 pinned first, as the tests run them; they run on the CPU
# too) and this package, then start the server on the built-in model.
# Extra arguments go to encode-server, e.g. `bash scripts/serve.sh --port 30001 --max-wait-ms 5`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/encode-server "$@"
