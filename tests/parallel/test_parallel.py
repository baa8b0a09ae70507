"""Tensor-parallel ranks and data-parallel replicas on CPU (gloo), as real processes."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.models import ItemLayout, PreparedBatch, load_adapter
from encode_server.models.sharding.blocks import reorder_fused_qkv
from encode_server.parallel.channel import pack_batch, pack_result, unpack_batch, unpack_result
from encode_server.parallel.tensor_parallel import layout_digest
from tests.support.helpers import ServerProcess, image_b64, run_python_module


@pytest.fixture(scope="module")
def reference():
    return load_adapter("tiny-qwen2.5-vl", "cpu", "float32")


def encode_alone(adapter, items_b64: list[str]) -> np.ndarray:
    images = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in items_b64]
    return adapter.forward(adapter.processor.preprocess("image", images)).numpy()


def embedding(body: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"])


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


async def burst(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(url + "/encode", json=body) for body in bodies))


def bodies_for(tag: str, count: int) -> tuple[list[dict], list[list[str]]]:
    items = [[image_b64(56 + 14 * (i % 4), 56 + 28 * (i % 3), seed=i)] * (1 + i % 2) for i in range(count)]
    return [{"req_id": f"{tag}{i}", "modality": "image", "mm_items": it, "return_embedding": True}
            for i, it in enumerate(items)], items


# --- pieces -----------------------------------------------------------------------------------

def test_fused_qkv_reorder_gives_each_rank_its_own_heads():
    heads, head_dim, dim, world = 4, 3, 12, 2
    linear = torch.nn.Linear(dim, 3 * dim)
    original_w, original_b = linear.weight.detach().clone(), linear.bias.detach().clone()
    reorder_fused_qkv(linear, heads, world)
    q, k, v = original_w.view(3, heads, head_dim, dim)
    for rank, chunk in enumerate(linear.weight.detach().chunk(world)):
        mine = slice(rank * heads // world, (rank + 1) * heads // world)
        want = torch.cat([q[mine].reshape(-1, dim), k[mine].reshape(-1, dim), v[mine].reshape(-1, dim)])
        assert torch.equal(chunk, want)
    qb, kb, vb = original_b.view(3, heads, head_dim)
    assert torch.equal(linear.bias.detach().chunk(world)[1], torch.cat([qb[2:].flatten(), kb[2:].flatten(),
                                                                      vb[2:].flatten()]))


def test_layout_digest_tells_batches_apart():
    batch = PreparedBatch("image", {"pixel_values": torch.zeros(16, 8)}, [ItemLayout(4, (1, 4, 4))])
    same = PreparedBatch("image", {"pixel_values": torch.ones(16, 8)}, [ItemLayout(4, (1, 4, 4))])
    other = PreparedBatch("image", {"pixel_values": torch.zeros(24, 8)}, [ItemLayout(6, (1, 4, 6))])
    assert layout_digest(batch) == layout_digest(same) >= 0
    assert layout_digest(batch) != layout_digest(other)
    assert layout_digest(None) == -1


def test_channel_round_trips_batches_and_results():
    frames = pack_batch(7, "video", [b"abc", [b"f1", b"f2"], b""])
    assert unpack_batch([bytes(f) for f in frames]) == (7, "video", [b"abc", [b"f1", b"f2"], b""])
    rows = torch.randn(5, 3).to(torch.bfloat16)
    batch_id, got, layouts, error = unpack_result([bytes(f) for f in pack_result(3, rows, [ItemLayout(5, (1, 1, 5))])])
    assert (batch_id, error, layouts) == (3, None, [ItemLayout(5, (1, 1, 5))]) and torch.equal(got, rows)
    assert unpack_result(pack_result(4, None, [], error="boom"))[3] == "boom"


# --- tensor parallel ----------------------------------------------------------------------------

def test_tp2_equals_tp1_and_a_killed_rank_fails_fast(reference):
    with ServerProcess("--tp-size", "2", "--max-wait-ms", "300", "--min-batch-size", "100",
                       "--hard-timeout-additional-s", "0.2") as server:
        ranks = httpx.get(server.url + "/server_info").json()["ranks"]
        assert [(r["rank"], r["role"], r["alive"]) for r in ranks] == [(0, "tp", True), (1, "tp", True)]
        assert ranks[0]["pid"] == server.proc.pid and ranks[1]["pid"] != server.proc.pid
        bodies, items = bodies_for("tp", 6)
        responses = asyncio.run(burst(server.url, bodies))
        for response, request_items in zip(responses, items):
            assert response.status_code == 200, response.text
            assert response.json()["batch_size"] == 6
            assert rel(embedding(response.json()), encode_alone(reference, request_items)) <= 1e-5

        async def kill_with_a_request_queued():
            async with httpx.AsyncClient(timeout=60) as client:
                queued = asyncio.ensure_future(client.post(server.url + "/encode", json={
                    "req_id": "queued", "modality": "image", "mm_items": [image_b64(56, 56)]}))
                await asyncio.sleep(0.1)
                os.kill(ranks[1]["pid"], signal.SIGKILL)
                started = time.monotonic()
                while (await client.get(server.url + "/health")).status_code == 200:
                    assert time.monotonic() - started < 5, "/health must turn 503 within 5 s"
                    await asyncio.sleep(0.05)
                unhealthy_after = time.monotonic() - started
                answer = await queued
                fresh_started = time.monotonic()
                fresh = await client.post(server.url + "/encode", json={
                    "req_id": "fresh", "modality": "image", "mm_items": [image_b64(56, 56)]})
                return unhealthy_after, answer, fresh, time.monotonic() - fresh_started

        unhealthy_after, queued, fresh, fresh_s = asyncio.run(kill_with_a_request_queued())
        assert unhealthy_after < 5
        assert queued.status_code == 503 and "rank 1" in queued.json()["message"]
        assert fresh.status_code == 503 and fresh_s < 1.0
        info = httpx.get(server.url + "/server_info").json()["ranks"]
        assert [r["alive"] for r in info] == [True, False]


def test_tp_size_that_does_not_divide_the_heads_is_refused_at_start():
    result = run_python_module("encode_server", "--tp-size", "3", "--port", "0", timeout=180)
    assert result.returncode != 0
    assert "4 attention heads do not split over 3" in result.stderr
    # Reported once, in one line: no rank's traceback before it, no "rank N exited" for the ranks it stops.
    assert "Traceback" not in result.stderr, result.stderr
    assert len([line for line in result.stderr.splitlines() if "do not split" in line]) == 1, result.stderr
    assert "exited with code" not in result.stderr, result.stderr


def test_tp_and_dp_together_are_refused():
    result = run_python_module("encode_server", "--tp-size", "2", "--dp-size", "2", timeout=60)
    assert result.returncode != 0 and "cannot both" in result.stderr


# --- data parallel ------------------------------------------------------------------------------

def test_dp2_serves_concurrent_load_on_both_replicas_and_survives_losing_one(reference):
    with ServerProcess("--dp-size", "2", "--log-level", "debug") as server:  # each batch's line names its replica
        deadline = time.monotonic() + 90
        while "replica=1" not in server.log() and time.monotonic() < deadline:
            bodies, _ = bodies_for("warm", 8)
            asyncio.run(burst(server.url, bodies))  # until the second replica has loaded and taken a batch
        bodies, items = bodies_for("dp", 48)
        responses = asyncio.run(burst(server.url, bodies))
        for response, request_items in zip(responses, items):
            assert response.status_code == 200, response.text
            assert rel(embedding(response.json()), encode_alone(reference, request_items)) <= 1e-5
        assert "replica=0" in server.log() and "replica=1" in server.log(), "both replicas should take batches"
        replica = httpx.get(server.url + "/server_info").json()["ranks"][1]
        os.kill(replica["pid"], signal.SIGKILL)
        time.sleep(0.5)
        bodies, _ = bodies_for("after", 16)
        assert all(r.status_code == 200 for r in asyncio.run(burst(server.url, bodies)))
        assert httpx.get(server.url + "/health").status_code == 200
        assert [r["alive"] for r in httpx.get(server.url + "/server_info").json()["ranks"]] == [True, False]
