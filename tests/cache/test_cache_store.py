"""The embedding cache's shared tier (`--cache-store`) against a real `mooncake_master` on loopback: a pool
of servers encodes each item once, a restarted server answers warm, the master lost mid-run costs no
request, a Store of another protocol is refused, corrupt objects are misses, and the objects are vLLM
0.33's (`mooncake_store_embedding`: key `<namespace>@id:<identifier>`, value `<IIQQ` header then rows),
checked here from that documented layout, not from the server's code."""

from __future__ import annotations

import base64
import json
import re
import struct
import time

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.support.helpers import InProcessServer, decode_embedding, png_bytes
from tests.support.mooncake_store import (
    FLOAT32_CODE,
    MAGIC,
    Master,
    peer,
    pool,
    store_args,
    vllm_get,
    vllm_key,
    vllm_put,
    wait_for,
)
from tests.support.optional import import_or_skip

mooncake_store = import_or_skip("mooncake", "mooncake.store")


@pytest.fixture
def master():
    running = Master().start()
    try:
        yield running
    finally:
        running.kill()


@pytest.fixture(scope="module")
def shared_pool():
    """(master, holder) for the tests that leave the master running and its marker alone: closing the peer that
    lends the memory takes Mooncake about 2 s, so they share one. Each test's items (and so keys) are its own."""
    with pool() as (master, holder):
        yield master, holder


def encode(server, image: bytes, req_id: str = "r") -> dict:
    response = httpx.post(server.url + "/encode", timeout=60, json={
        "req_id": req_id, "modality": "image", "mm_items": [base64.b64encode(image).decode()],
        "return_embedding": True})
    assert response.status_code == 200, response.text
    return response.json()


def forwards(server) -> float:
    return server.metric("encoder_batch_tokens_count", modality="image")


def published(server) -> float:
    return server.metric("encoder_cache_store_published_total")


def store_info(server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()["cache_store"]


def vllm_header(value: bytes) -> tuple[int, int, int, int]:
    return struct.unpack_from("<IIQQ", value)


NAMESPACE = re.compile(r"^encode-server@model:(?P<model>[^@]+)@revision:default@encoder:(?P<encoder>[0-9a-f]+)"
                       r"@dtype:torch\.float32@protocol:v3$")


def test_a_pool_encodes_each_item_once(shared_pool):
    master, holder = shared_pool
    image = png_bytes(64, 48, seed=11)
    with InProcessServer(*store_args(master)) as first, InProcessServer(*store_args(master)) as second, \
            InProcessServer(*store_args(master)) as third:
        answer = encode(first, image)
        assert answer["items"][0]["cached"] is False and "cache_tier" not in answer["items"][0]
        wait_for(lambda: published(first) >= 1, what="the item to be published")
        before = forwards(second), forwards(third)
        from_second, from_third = encode(second, image), encode(third, image)
        assert (forwards(second), forwards(third)) == before  # no forward on either
        for body in (from_second, from_third):
            assert body["items"][0] == {**answer["items"][0], "cached": True, "cache_tier": "store"}
            assert body["batch_size"] == 0
            assert np.array_equal(decode_embedding(body), decode_embedding(answer))  # bit-identical rows
        again = encode(second, image)  # now in its local tier
        assert again["items"][0]["cache_tier"] == "local"
        assert second.metric("encoder_cache_store_hits_total") == 1
        assert second.metric("encoder_cache_store_read_seconds_count") >= 1
        info = store_info(first)
        assert info["state"] == "connected" and info["published"] == 1 and info["publish_drops"] == 0
        namespace = NAMESPACE.match(info["namespace"])
        assert namespace and namespace["model"] == "tiny-qwen2.5-vl"

        # The object in vLLM's layout, read back with the raw client: the header, then the rows we answered.
        rows = decode_embedding(answer)
        keys = [key for key in _keys_with_prefix(holder, info["namespace"] + "@id:")]
        assert len(keys) == 1 and re.fullmatch(r"[0-9a-f]{64}", keys[0].rpartition("@id:")[2])
        value = bytes(holder.get(keys[0]))
        assert vllm_header(value) == (MAGIC, FLOAT32_CODE, rows.shape[0], rows.shape[1])
        assert len(value) == 24 + rows.size * 4
        assert np.array_equal(np.frombuffer(value[24:], "<f4").reshape(rows.shape), rows)

        # Restarted (a new process state, an empty local tier): answered warm from the Store.
    with InProcessServer(*store_args(master)) as restarted:
        body = encode(restarted, image)
        assert body["batch_size"] == 0  # no forward served it
        assert body["items"][0]["cache_tier"] == "store" and store_info(restarted)["hits"] == 1
        assert np.array_equal(decode_embedding(body), decode_embedding(answer))


def _keys_with_prefix(store, prefix: str) -> list[str]:
    """The published keys under a prefix that the Store holds (a Store lists no keys: the test records them)."""
    return [key for key in dict.fromkeys(_published_keys) if key.startswith(prefix) and store.is_exist(key) == 1]


_published_keys: list[str] = []


@pytest.fixture(autouse=True)
def _record_keys(monkeypatch):
    """Remember every key the in-process servers queue for publishing."""
    from encode_server.cache.store_client import StoreConnection

    original = StoreConnection.publish
    _published_keys.clear()

    def recording(self, objects, size=None):
        _published_keys.extend(key for key, _ in objects)
        return original(self, objects, size)

    monkeypatch.setattr(StoreConnection, "publish", recording)


def test_the_master_lost_mid_run_costs_no_request(master):
    holder = peer(master)
    with InProcessServer(*store_args(master, "--req-timeout-s", "10")) as server, \
            InProcessServer(*store_args(master)) as other:
        encode(server, png_bytes(40, 40, seed=1))
        wait_for(lambda: published(server) >= 1, what="the first item to be published")
        master.kill()
        started = time.monotonic()
        for seed in range(2, 8):  # new items and the first again: every one answered, none waits on the Store
            encode(server, png_bytes(40, 40, seed=seed), req_id=f"down-{seed}")
            assert encode(other, png_bytes(40, 40, seed=seed))["items"][0]["cached"] in (False, True)
        encode(other, png_bytes(40, 40, seed=1))
        assert time.monotonic() - started < 10
        wait_for(lambda: store_info(server)["state"] == "lost", what="the loss to be seen")
        assert server.metric("encoder_cache_store_up") == 0
        master.start()  # a new master: it knows no client, no object
        holder.close()
        holder = peer(master)
        wait_for(lambda: store_info(server)["state"] == "connected" and store_info(other)["state"] == "connected",
                 timeout=30, what="both servers to reconnect")
        assert store_info(server)["reconnects"] >= 1
        fresh = png_bytes(40, 40, seed=99)
        answer = encode(server, fresh)
        wait_for(lambda: store_info(server)["published"] >= 2, what="a publish after the reconnect")
        body = encode(other, fresh)
        assert body["items"][0]["cache_tier"] == "store" and body["batch_size"] == 0
        assert np.array_equal(decode_embedding(body), decode_embedding(answer))
    holder.close()


def test_a_master_down_at_start_is_joined_later():
    master = Master()  # not started yet
    started = time.monotonic()
    with InProcessServer(*store_args(master)) as server:
        assert time.monotonic() - started < 30  # Mooncake's own setup would wait ~90 s for a missing master
        encode(server, png_bytes(32, 32, seed=5))  # served from the encoder meanwhile
        assert store_info(server)["state"] == "connecting"
        assert server.metric("encoder_cache_store_publish_drops_total") == 1  # nowhere to publish it yet
        master.start()
        try:
            holder = peer(master)
            wait_for(lambda: store_info(server)["state"] == "connected", timeout=40, what="the connection")
            encode(server, png_bytes(32, 32, seed=6))
            wait_for(lambda: published(server) >= 1, what="the publish")
            holder.close()
        finally:
            master.kill()


def test_two_pods_encoding_one_item_at_once_both_answer_and_the_store_keeps_one_value(shared_pool):
    import concurrent.futures

    master, holder = shared_pool
    image = png_bytes(56, 56, seed=21)
    with InProcessServer(*store_args(master)) as first, InProcessServer(*store_args(master)) as second:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda server: encode(server, image), (first, second)))
        assert np.array_equal(decode_embedding(answers[0]), decode_embedding(answers[1]))
        wait_for(lambda: published(first) + published(second)
                 + first.metric("encoder_cache_store_hits_total") + second.metric("encoder_cache_store_hits_total")
                 >= 2, what="both pods to publish or read")
        namespace = store_info(first)["namespace"]
        (key,) = _keys_with_prefix(holder, namespace + "@id:")
        value = bytes(holder.get(key))
        rows = decode_embedding(answers[0])
        assert np.array_equal(np.frombuffer(value[24:], "<f4").reshape(rows.shape), rows)


def test_corrupt_objects_are_counted_misses_never_rows(shared_pool):
    master, holder = shared_pool
    kinds = ("truncated", "bad magic", "another dtype", "another width")
    images = {kind: png_bytes(48, 48, seed=31 + index) for index, kind in enumerate(kinds)}
    answers, keys = {}, {}
    with InProcessServer(*store_args(master)) as first:
        for kind, image in images.items():
            answers[kind] = encode(first, image)
            wait_for(lambda: published(first) >= len(answers), what="the publish")
            keys[kind] = [key for key in _published_keys if "@id:" in key][-1]
    for kind, key in keys.items():
        good, shape = bytes(holder.get(key)), decode_embedding(answers[kind]).shape
        value = {"truncated": good[:-4],
                 "bad magic": struct.pack("<IIQQ", 0xDEADBEEF, FLOAT32_CODE, *shape) + good[24:],
                 "another dtype": struct.pack("<IIQQ", MAGIC, 12, *shape) + good[24:],
                 "another width": struct.pack("<IIQQ", MAGIC, FLOAT32_CODE, shape[0] * 2, shape[1] // 2) + good[24:],
                 }[kind]
        assert holder.upsert(key, value) == 0 and bytes(holder.get(key)) == value
    with InProcessServer(*store_args(master)) as fresh:
        for count, (kind, image) in enumerate(images.items(), start=1):
            body = encode(fresh, image)
            assert body["items"][0]["cached"] is False, kind  # encoded, not served from the bad object
            assert np.array_equal(decode_embedding(body), decode_embedding(answers[kind])), kind
            assert fresh.metric("encoder_cache_store_corrupt_total") == count, kind


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the refused server's thread
def test_a_store_of_an_unreadable_protocol_is_refused(master):
    from encode_server.cache.store_client import StoreConfig, StoreConnection, StoreRefused

    holder = peer(master)
    assert holder.put("encode-server@store-protocol", json.dumps({"protocol": "v9"}).encode()) == 0
    connection = StoreConnection(StoreConfig(f"127.0.0.1:{master.port}", global_segment_size=0,
                                             local_buffer_size=16 << 20), "test")
    with pytest.raises(StoreRefused, match="protocol 'v9'.*reads v3 only"):
        connection.start()
    connection.close()
    with pytest.raises(RuntimeError, match="did not start"):
        with InProcessServer(*store_args(master)):
            pass
    holder.close()


def chat(server, *parts: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny-qwen2.5-vl", "max_tokens": 1,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]})


def image_part(data: bytes, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
    return {**part, "uuid": uuid} if uuid else part


def test_vllm_objects_both_ways(shared_pool, tmp_path):
    master, holder = shared_pool
    with InProcessServer(*store_args(master, "--ec-storage", str(tmp_path / "ec"))) as server:
        width = httpx.get(server.url + "/server_info").json()["model"]["row_widths"]["image"]
        wait_for(lambda: forwards(server) >= 1, what="the start-up health probe's forward")
        probe_forwards = forwards(server)
        # What vLLM's client writes, as it writes it (store_client.put_tensor: the header and the tensor as two
        # registered buffers of one object, replicated as a TENSOR object), read by the producer instead of
        # encoding.
        rows = torch.randn(16, width)
        value = struct.pack("<IIQQ", MAGIC, FLOAT32_CODE, 16, width) + rows.numpy().astype("<f4").tobytes()
        vllm_put(holder, vllm_key("from-vllm"), rows)
        response = chat(server, image_part(png_bytes(64, 64, seed=41), uuid="from-vllm"))
        assert response.status_code == 200, response.text
        (item,) = response.json()["encoder_cache"]
        assert item["identifier"] == "from-vllm" and item["hit"] and item["tokens"] == 16
        assert response.json()["ec_transfer_params"]["from-vllm"]["item_indices"] == [0]
        assert forwards(server) == probe_forwards  # nothing encoded
        assert server.metric("encoder_cache_store_hits_total") == 1
        stored = load_file(str(tmp_path / "ec" / "from-vllm" / "encoder_cache.safetensors"))["ec_cache"]
        assert torch.equal(stored, rows)

        # The same kind of object under another model's or dtype's namespace is never found: encoded instead.
        for other in (vllm_key("elsewhere", model="another/model"),
                      vllm_key("elsewhere").replace("dtype:torch.float32", "dtype:torch.bfloat16")):
            assert holder.put(other, value) == 0
        response = chat(server, image_part(png_bytes(64, 64, seed=43), uuid="elsewhere"))
        assert response.status_code == 200 and not response.json()["encoder_cache"][0]["hit"]
        assert forwards(server) == probe_forwards + 1

        # What the producer encodes, published where vLLM's client reads it.
        response = chat(server, image_part(png_bytes(64, 64, seed=42), uuid="from-us"))
        assert response.status_code == 200, response.text
        wait_for(lambda: holder.is_exist(vllm_key("from-us")) == 1, what="the publish")
        ours = load_file(str(tmp_path / "ec" / "from-us" / "encoder_cache.safetensors"))["ec_cache"]
        value = vllm_get(holder, vllm_key("from-us"), 24 + ours.numel() * 4)  # as vLLM's load_tensors reads it
        assert struct.unpack_from("<IIQQ", value) == (MAGIC, FLOAT32_CODE, ours.shape[0], width)
        assert torch.equal(torch.from_numpy(np.frombuffer(value[24:], "<f4").reshape(ours.shape).copy()), ours)


def test_a_store_with_no_memory_lent_yet_connects_and_publishes_once_it_has_some(master):
    with InProcessServer(*store_args(master)) as server:
        wait_for(lambda: store_info(server)["state"] == "connected", what="the connection")
        encode(server, png_bytes(36, 36, seed=61))  # nowhere to put it: a publish error, not a failed request
        wait_for(lambda: store_info(server)["publish_errors"] == 1, what="the failed publish")
        holder = peer(master)
        encode(server, png_bytes(36, 36, seed=62))
        wait_for(lambda: published(server) == 1, what="the publish")
    holder.close()
