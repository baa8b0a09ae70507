#!/usr/bin/env bash
# Build a side venv in which tools/compat/vllm_compat.py (and tools/reference/vllm_golden.py) run vLLM's own code
# against this server, for vLLM 0.33.0 (the default) or another release this server speaks (0.32.0). Never the project's venv: vLLM is not a dependency, and the install is several GB.
# vLLM is installed without its dependencies (its GPU kernels are not needed: `import vllm` works on a CPU
# machine); then exactly what importing its hasher, media loader, chat parsing, multimodal processors and
# ECExampleConnector asks for. Versions are the ones the checks were run with.
#
#   tools/compat/vllm_compat.sh [VERSION [VENV]]   # default 0.33.0 in .vllm-venv; another VERSION in
#                                                   # .vllm-venv-VERSION (both gitignored)
#   VLLM_TARGET_DEVICE=cpu VENV/bin/python tools/compat/vllm_compat.py      # runs the server from .venv
#   VLLM_TARGET_DEVICE=cpu VENV/bin/python tools/reference/vllm_golden.py check
#   VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1 VENV/bin/python tools/compat/vllm_transport_compat.py
#   VLLM_TARGET_DEVICE=cpu VENV/bin/python tools/compat/vllm_cpu_compat.py
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="${1:-0.33.0}"
if [ "$VERSION" = 0.33.0 ]; then DEFAULT_VENV="$ROOT/.vllm-venv"; else DEFAULT_VENV="$ROOT/.vllm-venv-$VERSION"; fi
VENV="${2:-$DEFAULT_VENV}"
PYTHON="${PYTHON:-python3.11}"
PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" --no-deps "vllm==$VERSION"
# What vLLM's modules above import, at versions inside the pins of 0.32.0 and 0.33.0 (transformers <5.21).
"${PIP[@]}" transformers==5.20.2 tokenizers huggingface_hub "safetensors>=0.6.2" blake3 pybase64 cachetools \
    regex psutil msgspec cbor2 cloudpickle "pydantic>=2.12" "fastapi<0.137" "openai>=2.25" partial-json-parser \
    py-cpuinfo einops sentencepiece tiktoken "mistral_common[image]>=1.11.6" opencv-python-headless pyyaml \
    jsonschema "pillow>=13" "aiohttp>=3.14.4" pyzmq requests tqdm protobuf filelock watchfiles \
    python-json-logger prometheus-fastapi-instrumentator setproctitle ijson oss-harmony xgrammar llguidance
# This server's own dependencies (pyproject.toml), so the script can start it from the same venv.
"${PIP[@]}" "uvicorn>=0.29" "httptools>=0.6" "uvloop>=0.19" "orjson>=3.9" "numpy>=1.26" "prometheus_client>=0.20" \
    "soundfile>=0.12" "librosa>=0.10" "sortedcontainers>=2.4" "httpx>=0.27" "av>=12" "fastapi-offline>=1.7,<2"
# vLLM's GLM-4.1V module imports its compressed-tensors quantization layer (pinned 0.17.0).
"${PIP[@]}" --no-deps compressed-tensors==0.17.0
"${PIP[@]}" loguru
# tools/compat/vllm_store_compat.py: Mooncake Store's client and binaries, for vLLM's embedding store client.
"${PIP[@]}" "mooncake-transfer-engine-non-cuda>=0.3.13,<0.4"
# vLLM resamples audio with torchaudio (its own pin; pure Python where vLLM uses it).
"${PIP[@]}" --no-deps torchaudio==2.11.0
# The transfer libraries of ECMooncakeConnector and ECCPUConnector (tools/compat/vllm_transport_compat.py,
# tools/compat/vllm_cpu_compat.py).
"${PIP[@]}" mooncake-transfer-engine-non-cuda "nixl==1.5.1" msgpack
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps -e "$ROOT"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -W ignore -c "
import vllm
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.connector import MediaConnector
try:
    from vllm.renderers.chat_utils.chat_message import parse_chat_messages
except ImportError:  # 0.32
    from vllm.renderers.chat_utils import parse_chat_messages
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
print('vLLM', vllm.__version__, 'ready in $VENV')"
