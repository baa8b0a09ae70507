"""vLLM 0.33.0's own Mooncake Store embedding client against this server's shared tier, both ways.

Runs in the side venv that `tools/compat/vllm_compat.sh` builds (with Mooncake's client; its binaries load the
system's libibverbs1), from the repository root:

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python tools/compat/vllm_store_compat.py

On loopback it starts a `mooncake_master` and a `mooncake_client` lending 64 MB, and this server (the project's
.venv) with `--ec-storage` and `--cache-store`. Then, with vLLM's unchanged code
(`vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding`: `build_embedding_namespace`,
`make_embedding_key`, `MooncakeEmbeddingStoreClient.put_tensor` and `load_tensors`, on a store set up as vLLM's
connector sets one up):

1. the server encodes an item (`uuid` "from-server") and publishes it; vLLM's client loads it under the key
   vLLM computes, and it must equal the rows the server wrote for vLLM's ECExampleConnector;
2. vLLM's client puts an item (`uuid` "from-vllm", random rows of the model's width); the server must answer a
   chat request for it with those rows, bit for bit, and no encode.

Prints what it checked and exits 1 on any difference.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    import mooncake
    from mooncake.store import MooncakeDistributedStore, ObjectDataType, ReplicateConfig
    from safetensors.torch import load_file
    from vllm.config.multimodal import MultiModalConfig
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding import data, store_client

    from tests.support.helpers import ServerProcess, png_bytes

    binaries = Path(mooncake.__file__).parent
    port = free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    processes = [subprocess.Popen([str(binaries / "mooncake_master"), f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                                   f"--metrics_port={free_port()}", "--metrics_host=127.0.0.1",
                                   "--enable_metric_reporting=false"], **quiet)]
    failures = 0
    try:
        time.sleep(1.0)
        holder = [str(binaries / "mooncake_client"), f"--master_server_address=127.0.0.1:{port}",
                  "--metadata_server=P2PHANDSHAKE", "--global_segment_size=64MB", "--protocol=tcp", "--host=127.0.0.1",
                  f"--port={free_port()}"]
        processes.append(subprocess.Popen(holder, **quiet))
        time.sleep(1.0)
        raw = MooncakeDistributedStore()
        assert raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", f"127.0.0.1:{port}") == 0
        config = ReplicateConfig()
        config.data_type = ObjectDataType.TENSOR
        vllm_client = store_client.MooncakeEmbeddingStoreClient(raw, replicate_config=config,
                                                                read_buffer_bytes=16 << 20)
        model = "tiny-qwen2.5-vl"
        vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(model=model, revision=None, dtype=torch.float32,
                                               multimodal_config=MultiModalConfig()),
            ec_transfer_config=types.SimpleNamespace(ec_connector_extra_config={}))
        namespace = data.build_embedding_namespace(vllm_config)
        storage = Path(tempfile.mkdtemp(prefix="ec-"))
        python = str(ROOT / ".venv" / "bin" / "python")
        with ServerProcess("--model", model, "--cache-bytes", "64MiB", "--ec-storage", str(storage),
                           "--cache-store", f"mooncake://127.0.0.1:{port}", "--cache-store-global-segment-size", "0",
                           "--cache-store-local-buffer-size", "16MiB", python=python) as server:
            info = httpx.get(server.url + "/server_info").json()
            width = info["model"]["row_widths"]["image"]

            def chat(uuid: str, seed: int) -> dict:
                url = "data:image/png;base64," + base64.b64encode(png_bytes(64, 64, seed=seed)).decode()
                response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
                    "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": url}, "uuid": uuid}]}]})
                response.raise_for_status()
                return response.json()["encoder_cache"][0]

            item = chat("from-server", 1)
            written = load_file(str(storage / "from-server" / "encoder_cache.safetensors"))["ec_cache"]
            key = data.make_embedding_key(namespace, "from-server")
            deadline = time.monotonic() + 10
            while not vllm_client.exists(key) and time.monotonic() < deadline:
                time.sleep(0.05)
            loaded = vllm_client.load_tensors(
                {key: data.TensorSpec(tuple(written.shape), "torch.float32", written.numel() * 4)}, "cpu")
            same = key in loaded and torch.equal(loaded[key], written)
            failures += not same
            print(f"vLLM's client loads what the server published under {key}: "
                  f"{'identical rows' if same else 'DIFFERENT or missing'} ({tuple(written.shape)})")

            rows = torch.randn(12, width)
            vllm_client.put_tensor(data.make_embedding_key(namespace, "from-vllm"), rows)
            item = chat("from-vllm", 2)
            served = load_file(str(storage / "from-vllm" / "encoder_cache.safetensors"))["ec_cache"]
            store = httpx.get(server.url + "/server_info").json()["cache_store"]
            same = item["hit"] and item["tokens"] == 12 and torch.equal(served, rows) and store["hits"] == 1
            failures += not same
            print(f"the server serves what vLLM's client put: {'identical rows, not encoded' if same else 'NO'} "
                  f"({json.dumps(item)})")
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=10)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    sys.exit(main())
