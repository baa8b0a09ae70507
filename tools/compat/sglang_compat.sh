#!/usr/bin/env bash
# Build the side venv in which tools/compat/sglang_compat.py and tools/reference/sglang_golden.py run SGLang's own
# code against this server. Never the project's venv: SGLang is not a dependency, and the install is
# several GB (torch's CUDA build, which runs on CPU too). Versions are the ones the checks were run with.
#
#   tools/compat/sglang_compat.sh [VENV]           # default VENV: .sglang-venv in the repository (gitignored)
#   PYTHONPATH=$PWD VENV/bin/python tools/compat/sglang_compat.py
#   PYTHONPATH=$PWD VENV/bin/python tools/reference/sglang_golden.py check
#   MOONCAKE_PROTOCOL=tcp MC_FORCE_TCP=1 PYTHONPATH=$PWD VENV/bin/python tools/compat/sglang_transport_compat.py
#   PYTHONPATH=$PWD VENV/bin/python tools/compat/sglang_grpc_compat.py   # SGLang's gRPC receiver against --grpc-port
#   python benchmarks/sglang_compare.py --sglang-python VENV/bin/python   # SGLang's own encoder server against ours
set -euo pipefail

VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.sglang-venv}"
PYTHON="${PYTHON:-python3.11}"
PIP=("$VENV/bin/pip" install --disable-pip-version-check)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1 transformers==5.23.0
# SGLang itself without its GPU kernels and servers; then exactly what importing
# sglang.srt.disaggregation.encoder.receiver asks for, at the versions SGLang 0.5.23 pins where it pins.
"${PIP[@]}" --no-deps sglang==0.5.23
"${PIP[@]}" ipython==9.18.1 msgspec==0.22.0 pybase64==1.5.1 psutil==7.2.2 apache-tvm-ffi==0.1.11 \
    sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf==0.19.0 openai==2.8.0 partial-json-parser==0.2.1.1.post7 \
    dill==0.4.1 setproctitle==1.3.8 python-multipart==0.0.34
# The Muse Spark, Dots3-Note, Kimi K2.5, GLM-4V / GLM-5-Next and MiniMax-M3 processors import their model
# modules, which import einops; the compat script sends a video file, which this server decodes with PyAV.
"${PIP[@]}" einops==0.8.2 av==18.1.0
# This server's own dependencies (pyproject.toml), so the script can start it from the same venv.
"${PIP[@]}" "fastapi>=0.110" "uvicorn>=0.51" "httptools>=0.6" "uvloop>=0.19" "pydantic>=2.6" "aiohttp>=3.9" \
    "pyzmq>=26.4" "orjson>=3.9" "pillow>=10" "numpy>=1.26" "prometheus_client>=0.20" "safetensors>=0.4" \
    "soundfile>=0.12" "librosa>=0.10" "sortedcontainers>=2.4" "httpx>=0.27" "huggingface_hub>=1.31,<3" "blake3>=0.4" \
    "fastapi-offline>=1.7,<2"
# SGLang's gRPC encoder protocol (SGLANG_ENCODER_MM_RECEIVER_MODE=grpc): its generated classes and grpcio, which
# SGLang's receiver imports when its encoder URLs are grpc://, and this server's grpc extra.
"${PIP[@]}" "smg-grpc-proto>=0.4.28,<0.5" "grpcio>=1.81.1" "grpcio-health-checking>=1.81.1" "grpcio-reflection>=1.81.1"
# Mooncake's TransferEngine, for the mooncake backend (tools/compat/sglang_transport_compat.py).
"${PIP[@]}" mooncake-transfer-engine-non-cuda
"$VENV/bin/python" -W ignore -c "import sglang, sglang.srt.disaggregation.encoder.receiver; print('SGLang', sglang.__version__, 'ready in $VENV')"
