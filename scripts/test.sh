#!/usr/bin/env bash
# Set up .venv (torch 2.14.1 and torchvision 0.29.1 pinned first: the processors transformers picks on GPU
# machines are the ones tested; they run on the CPU too) and this package with its test extra; run the tests.
# Extra arguments go to pytest: `bash scripts/test.sh -m quick` for the quick tier, `-m slow` for the long
# benchmarks and soaks (run serially).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest "$@"
