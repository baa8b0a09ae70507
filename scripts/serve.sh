#!/usr/bin/env bash
# Set up .venv (CPU torch pinned first, then this package) and start the server on the built-in model.
# Extra arguments go to encode-server, e.g. `bash scripts/serve.sh --port 30001 --max-wait-ms 5`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e .
exec .venv/bin/encode-server "$@"
