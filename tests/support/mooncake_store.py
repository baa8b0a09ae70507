"""A real `mooncake_master` on loopback, a peer lending the pool memory, and Mooncake Store objects read and written
as vLLM 0.33's `mooncake_store_embedding` client does (key `<namespace>@id:<identifier>`, value `<IIQQ` header then
rows), written out from that documented layout, not from the server's code: for the shared tier's tests
(`tests/cache/test_cache_store.py`, with `--ec-storage`'s `ECExampleConnector`) and the pushing vLLM connectors'
(`tests/fronts/test_vllm_mooncake.py`, `test_vllm_cpu_p2p.py`)."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import struct
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.helpers import free_port, png_bytes
from tests.support.vllm_requests import data_url, image_part

MAGIC = 0x4D4F4F4E  # vLLM's _MOONCAKE_TENSOR_OBJECT_MAGIC
FLOAT32_CODE = 0
# vLLM 0.33.0's MultiModalConfig().compute_hash(): md5 of its printed default encoder factors.
VLLM_ENCODER_HASH = hashlib.md5(b"[None, 'weights', None, None, True]").hexdigest()


def master_binary() -> str:
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    check = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=30)
    if "error while loading shared libraries" in check.stderr:
        pytest.skip(f"mooncake_master cannot run here: {check.stderr.strip()} (Debian: apt-get install libibverbs1)")
    return str(path)


class Master:
    """A real mooncake_master on a loopback port; `kill` and `start` again on the same port."""

    def __init__(self) -> None:
        self.binary = master_binary()
        self.port = free_port()
        self.metrics_port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def start(self) -> Master:
        self.process = subprocess.Popen(
            [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", f"--metrics_port={self.metrics_port}",
             "--metrics_host=127.0.0.1", "--enable_metric_reporting=false", "--rpc_thread_num=2",
             "--client_ttl=5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("mooncake_master did not listen within 20 s")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@contextlib.contextmanager
def pool():
    """A master and one peer lending the pool its memory (the servers lend none)."""
    master = Master().start()
    holder = peer(master)
    try:
        yield master, holder
    finally:
        holder.close()
        master.kill()


def peer(master: Master, segment: int = 64 << 20):
    """A raw Mooncake Store client, as vLLM's embedding client sets one up; it lends the pool `segment` bytes."""
    from mooncake import store as mooncake_store

    store = mooncake_store.MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", f"127.0.0.1:{master.port}") == 0
    return store


def store_args(master: Master, *extra: str) -> tuple[str, ...]:
    # The servers lend no memory: what they publish lives in the peer's segment and outlives them.
    return ("--cache-bytes", "64MiB", "--health-probe-interval-s", "3600", "--cache-store", master.url,
            "--cache-store-global-segment-size", "0", "--cache-store-local-buffer-size", "16MiB", *extra)


def wait_for(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def vllm_key(identifier: str, model: str = "tiny-qwen2.5-vl") -> str:
    """vLLM 0.33's key for an item (build_embedding_namespace + make_embedding_key), written out by hand."""
    return (f"embedding@model:{model}@revision:default@encoder:{VLLM_ENCODER_HASH}@dtype:torch.float32"
            f"@protocol:v3@id:{identifier}")


def vllm_put(store, key: str, rows: torch.Tensor) -> None:
    """vLLM 0.33's MooncakeEmbeddingStoreClient.put_tensor: header and rows from two registered buffers."""
    import ctypes

    from mooncake import store as mooncake_store

    header = struct.pack("<IIQQ", MAGIC, FLOAT32_CODE, *rows.shape)
    header_buffer = (ctypes.c_ubyte * len(header)).from_buffer_copy(header)
    rows = rows.contiguous()
    buffers = [(ctypes.addressof(header_buffer), len(header)), (rows.data_ptr(), rows.numel() * rows.element_size())]
    for address, size in buffers:
        assert store.register_buffer(address, size) == 0
    config = mooncake_store.ReplicateConfig()
    config.data_type = mooncake_store.ObjectDataType.TENSOR
    try:
        [result] = store.batch_put_from_multi_buffers([key], [[address for address, _ in buffers]],
                                                      [[size for _, size in buffers]], config)
        assert result >= 0, result
    finally:
        for address, _ in buffers:
            store.unregister_buffer(address)


def vllm_get(store, key: str, size: int) -> bytes:
    """vLLM 0.33's _load_chunk: batch_get_into a registered buffer of the expected size, all of it or nothing."""
    buffer = torch.empty(size, dtype=torch.uint8)
    assert store.register_buffer(buffer.data_ptr(), size) == 0
    try:
        [result] = store.batch_get_into([key], [buffer.data_ptr()], [size])
    finally:
        store.unregister_buffer(buffer.data_ptr())
    assert result == size, result
    return buffer.numpy().tobytes()


def _forwards(server) -> float:
    return server.metric("encoder_batch_tokens_count", modality="image")


def check_vllm_connector_with_the_store(server, holder, send, received, model: str) -> None:
    """A Store hit (named by uuid) answers with vLLM's rows, handed over and not encoded; an item encoded here is
    published under vLLM's key with the rows handed over. `send(parts)` answers the chat request;
    `received(identifier, entry)` reads back what the consumer got."""
    width = httpx.get(server.url + "/server_info").json()["model"]["row_widths"]["image"]
    wait_for(lambda: _forwards(server) >= 1, what="the start-up health probe's forward")
    before, hits = _forwards(server), server.metric("encoder_cache_store_hits_total")
    rows = torch.randn(12, width)
    vllm_put(holder, vllm_key("from-vllm", model), rows)
    response = send([image_part(data_url(png_bytes(48, 48, seed=71)), uuid="from-vllm")])
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["encoder_cache"] == [{"identifier": "from-vllm", "tokens": 12, "hit": True}]
    assert answer["ec_transfer_params"]["from-vllm"]["item_indices"] == [0]
    assert torch.equal(received("from-vllm", answer["ec_transfer_params"]["from-vllm"]), rows)
    assert _forwards(server) == before  # nothing encoded
    assert server.metric("encoder_cache_store_hits_total") == hits + 1

    response = send([image_part(data_url(png_bytes(40, 56, seed=72)))])  # no uuid: vLLM's hash names it
    assert response.status_code == 200, response.text
    [item] = response.json()["encoder_cache"]
    assert not item["hit"] and _forwards(server) == before + 1
    ours = received(item["identifier"], response.json()["ec_transfer_params"][item["identifier"]])
    key = vllm_key(item["identifier"], model)
    wait_for(lambda: holder.is_exist(key) == 1, what="the publish")
    value = vllm_get(holder, key, 24 + ours.numel() * 4)
    assert torch.equal(torch.frombuffer(bytearray(value[24:]), dtype=torch.float32).reshape(ours.shape), ours)
