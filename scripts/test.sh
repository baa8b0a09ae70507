#!/usr/bin/env bash
# Set up .venv (CPU torch pinned first, then this package with its test extra) and run the tests.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` for the long benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest "$@"
