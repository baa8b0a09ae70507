# encode-server on an NVIDIA GPU. Build from the repository root:
#
#   docker build -t registry.example.com/encode-server:0.1.0 .
#
# (registry.example.com: your registry; deploy/kubernetes/encode-server.yaml runs the same image name.)
# Run it with the NVIDIA container toolkit; arguments after the image name go to encode-server, and every
# flag can also be an ENCODER_* variable (docker run -e ...). A Hub id is downloaded (only the encoder's
# tensors) into HF_HOME=/cache/huggingface: keep /cache on a named volume, or every new container downloads
# again. Give /dev/shm room (docker's default is 64 MiB; tensor-parallel ranks and --preprocess-workers
# need more):
#
#   docker run --gpus all --init --stop-timeout 60 --shm-size 8g -p 30000:30000 -v encode-server-hf:/cache \
#     registry.example.com/encode-server:0.1.0 --model Qwen/Qwen2.5-VL-7B-Instruct
#
# or with a checkpoint folder of your own, mounted read-only:
#
#   docker run --gpus all --init --stop-timeout 60 --shm-size 8g -p 30000:30000 -v /models:/models:ro \
#     registry.example.com/encode-server:0.1.0 --model /models/Qwen2.5-VL-7B-Instruct
#
# The server listens on 0.0.0.0:30000 (ENCODER_HOST, ENCODER_PORT below; the health check reads
# ENCODER_PORT, so change the port with -e ENCODER_PORT=..., not --port). On SIGTERM it drains for
# --drain-timeout-s (30 s) before it exits: keep docker's stop timeout above it.
#
# torch: PyPI's Linux wheels of torch 2.14.1 (and torchvision 0.29.1) are CUDA 13.0 builds that bring their own CUDA libraries
# (the nvidia-* packages), so the image needs no CUDA toolkit of its own: nvidia/cuda's "base" flavour
# has what the container toolkit looks for (it mounts the host's driver, and refuses a driver too old for
# CUDA 13.0 with a clear message). A host whose driver supports CUDA 12 only takes a CUDA 12 build of torch
# from the PyTorch package index:
#
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t registry.example.com/encode-server:0.1.0 .
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.14.1
# torchvision: the processors transformers runs on GPU machines (and the ones the tests run) need it.
ARG TORCHVISION_VERSION=0.29.1
ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates libibverbs1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch and torchvision first, from the index chosen above, so that installing the package keeps that (CUDA) build.
RUN pip install "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" --index-url "${TORCH_INDEX_URL}"

# The package with its video extra (PyAV decodes video files), its vllm extra (OpenCV decodes the
# vLLM producer's video items, as vLLM does) and its mooncake extra (the --cache-store client, and the
# mooncake_master that deploy/kubernetes/mooncake-master.yaml runs from this same image; both load
# libibverbs even over TCP); soundfile, PyAV and OpenCV wheels carry their own libsndfile and FFmpeg.
WORKDIR /tmp/encode-server
COPY pyproject.toml README.md ./
COPY encode_server ./encode_server
RUN pip install ".[video,vllm,mooncake]" \
    && python -c "import torch, encode_server; print('encode-server', encode_server.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda)" \
    && rm -rf /tmp/encode-server

# A fixed uid and gid (10001), which Kubernetes' securityContext names (deploy/kubernetes/encode-server.yaml);
# /cache holds HF_HOME, owned by that user so that a new named volume mounted there is writable too.
RUN groupadd --system --gid 10001 encoder \
    && useradd --system --uid 10001 --gid encoder --create-home encoder \
    && mkdir -p /cache/huggingface && chown -R encoder:encoder /cache
USER encoder
WORKDIR /home/encoder

ENV ENCODER_HOST=0.0.0.0 \
    ENCODER_PORT=30000 \
    HF_HOME=/cache/huggingface
EXPOSE 30000
STOPSIGNAL SIGTERM
# /health answers 200 once the model is loaded and a tiny input goes through it; loading a large model
# takes minutes, hence the start period.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('ENCODER_PORT', '30000'), timeout=8)"

ENTRYPOINT ["encode-server"]
