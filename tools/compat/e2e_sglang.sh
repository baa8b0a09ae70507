#!/usr/bin/env bash
# Build the side venv in which tools/compat/e2e_sglang.py runs whole SGLang 0.5.23 servers on the CPU: the venv
# of tools/compat/sglang_compat.sh (SGLang without its GPU kernels, torch's CUDA build, which runs on the CPU),
# plus what launching its HTTP server, scheduler and detokenizer imports. Never the project's venv: SGLang is
# not a dependency, and the install is several GB. Versions are the ones the run was made with.
#
#   tools/compat/e2e_sglang.sh [VENV]        # default VENV: .sglang-venv in the repository (gitignored)
#   PYTHONPATH=$PWD .venv/bin/python tools/compat/e2e_sglang.py --sglang-python VENV/bin/python
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.sglang-venv}"
PIP=("$VENV/bin/pip" install --disable-pip-version-check -q)

bash "$ROOT/tools/compat/sglang_compat.sh" "$VENV"
# What `python -m sglang.launch_server` imports on the way to serving (pins where SGLang 0.5.23 pins).
"${PIP[@]}" uvloop orjson interegular xxhash zstandard tiktoken "openai-harmony==0.0.4" "llguidance>=1.7.6,<2.0.0" \
    "xgrammar==0.2.7" "timm==1.0.25" "smg-grpc-servicer>=0.9.0" "smg-grpc-proto" grpcio grpcio-health-checking \
    grpcio-reflection blobfile==3.0.0 distro easydict jsonschema anthropic build einops gguf interegular ipython \
    "mistral_common>=1.11.5" msgspec ninja "openai==2.8.0" partial_json_parser "python-dateutil<3" python-multipart \
    watchfiles "kernels>=0.14.1,<0.15" "numba==0.65.1" scipy
"$VENV/bin/python" -W ignore -c "import sglang.launch_server, sglang.srt.entrypoints.http_server; print('SGLang server ready in $VENV')"
