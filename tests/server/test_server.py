"""The real server over HTTP on loopback: fusion, exact slicing, isolation of bad input, metrics and
health under load: the end-to-end contract (docs/CONTRACT.md, sections 2 and 4)."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.models.families.qwen2_5_vl import tiny_qwen25_vl
from tests.support.helpers import InProcessServer, ServerProcess, decode_embedding, image_b64, png_bytes, rel_diff

REQUIRED_METRICS = (
    "encoder_requests_total", "encoder_batch_size", "encoder_queue_wait_seconds", "encoder_preprocess_seconds",
    "encoder_forward_seconds", "encoder_transfer_seconds", "encoder_request_duration_seconds",
    "encoder_pending_requests", "encoder_embedding_bytes_sent_total",
)


@pytest.fixture(scope="module")
def default_server():
    # Loopback URLs are private addresses: this server is allowed to fetch them for the URL test.
    with ServerProcess("--allow-private-urls", "true") as server:
        yield server


@pytest.fixture(scope="module")
def batching_server():
    """Holds requests up to 400 ms for company, so a concurrent burst fuses deterministically."""
    with InProcessServer("--max-wait-ms", "400", "--min-batch-size", "64", "--hard-timeout-additional-s", "0.2",
                         "--max-batch-size", "32") as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    """The same built-in encoder in this process (same seed, so the same weights)."""
    return tiny_qwen25_vl(torch.device("cpu"), torch.float32)


def encode_alone(adapter, images_b64: list[str]) -> np.ndarray:
    images = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in images_b64]
    return adapter.forward(adapter.processor.preprocess("image", images)).numpy()


async def post_many(url: str, bodies: list[dict], timeout: float = 60.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=200)) as client:
        return await asyncio.gather(*(client.post(url + "/encode", json=body) for body in bodies))


# --- the basic contract -------------------------------------------------------------------------

def test_health_server_info_and_metric_names(default_server):
    assert httpx.get(default_server.url + "/health").json() == {"status": "ok"}
    info = httpx.get(default_server.url + "/server_info").json()
    assert info["model"]["name"] == "tiny-qwen2.5-vl"
    assert info["model"]["modalities"] == ["image", "video"]
    assert info["model"]["hidden_size"] == 128
    assert info["settings"]["max_batch_size"] == 32
    assert info["ranks"] == [{"rank": 0, "pid": default_server.proc.pid, "role": "tp", "alive": True}]
    httpx.post(default_server.url + "/encode", json={"req_id": "warm", "modality": "image",
                                                    "mm_items": [image_b64(56, 56)]})
    text = httpx.get(default_server.url + "/metrics").text
    for name in REQUIRED_METRICS:
        assert f"# TYPE {name}" in text or f"# TYPE {name.removesuffix('_total')} counter" in text, name


def test_load_report_and_autoscaling_series_over_http(default_server):
    """`GET /v1/load` as a router polls it, and the autoscaling series on /metrics (docs/OPERATIONS.md)."""
    load = httpx.get(default_server.url + "/v1/load")
    assert load.status_code == 200, load.text
    report = load.json()
    assert set(report["modalities"]) == {"image", "video"} and report["draining"] is False
    assert report["batches_in_flight_max"] >= 1 and report["queued"] == 0
    assert 0.0 <= report["last_minute"]["busy_fraction"] <= 1.0
    text = httpx.get(default_server.url + "/metrics").text
    for name in ("encoder_busy_fraction", "encoder_busy_seconds_total", "encoder_items_per_second",
                 "encoder_rows_per_second", "encoder_queue_wait_p99_seconds", "encoder_batches_in_flight",
                 'encoder_queued_requests{modality="image"}', 'encoder_queue_oldest_wait_seconds{modality="video"}'):
        assert f"\n{name} " in text, name


def test_encode_one_request_with_inline_embedding(default_server, reference):
    items = [image_b64(56, 84, seed=1), image_b64(112, 56, seed=2)]
    response = httpx.post(default_server.url + "/encode", json={
        "req_id": "one", "modality": "IMAGE", "mm_items": items, "return_embedding": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["req_id"] == "one" and body["modality"] == "image" and body["dtype"] == "float32"
    assert body["items"] == [{"tokens": 6, "grid_thw": [1, 6, 4]}, {"tokens": 8, "grid_thw": [1, 4, 8]}]
    assert body["embedding_shape"] == [14, 128]
    assert set(body["timings_ms"]) == {"queue", "preprocess", "encode", "transfer"}
    assert body["batch_size"] >= 1
    assert rel_diff(decode_embedding(body), encode_alone(reference, items)) <= 1e-5


def test_item_forms_url_data_uri_and_objects_agree(default_server):
    raw = png_bytes(56, 56, seed=3)
    b64 = base64.b64encode(raw).decode()
    forms = [b64, {"data": b64}, f"data:image/png;base64,{b64}", {"url": f"data:image/png;base64,{b64}"}]
    embeddings = []
    for index, form in enumerate(forms):
        response = httpx.post(default_server.url + "/encode", json={
            "req_id": f"form-{index}", "modality": "image", "mm_items": [form], "return_embedding": True})
        assert response.status_code == 200, response.text
        embeddings.append(decode_embedding(response.json()))
    for embedding in embeddings[1:]:
        assert np.array_equal(embedding, embeddings[0])


def test_http_url_items_are_fetched(default_server, tmp_path):
    """An http:// item is fetched from a loopback file server started by the test."""
    import functools
    import http.server
    import threading

    (tmp_path / "cat.jpg").write_bytes(png_bytes(84, 56, seed=4, fmt="JPEG"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        ok = httpx.post(default_server.url + "/encode", json={
            "req_id": "url", "modality": "image", "mm_items": [base + "/cat.jpg"]})
        assert ok.status_code == 200, ok.text
        assert ok.json()["items"] == [{"tokens": 6, "grid_thw": [1, 4, 6]}]
        missing = httpx.post(default_server.url + "/encode", json={
            "req_id": "url404", "modality": "image", "mm_items": [{"url": base + "/nope.png"}]})
        assert missing.status_code == 400 and "mm_items[0]" in missing.json()["message"]
        assert "404" in missing.json()["message"]
    finally:
        httpd.shutdown()


# --- fusion and exact slicing -------------------------------------------------------------------

def test_concurrent_requests_fuse_and_each_slice_equals_the_request_alone(batching_server, reference):
    sizes = [(56, 56), (84, 56), (112, 112), (56, 140), (200, 120), (64, 64), (300, 90), (57, 61)]
    bodies, expected = [], []
    for index in range(16):
        count = 1 + index % 3
        items = [image_b64(*sizes[(index + k) % len(sizes)], seed=100 + index * 3 + k) for k in range(count)]
        bodies.append({"req_id": f"fuse-{index}", "modality": "image", "mm_items": items,
                       "return_embedding": True})
        expected.append(encode_alone(reference, items))
    responses = asyncio.run(post_many(batching_server.url, bodies))
    for response, want in zip(responses, expected):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["batch_size"] == 16, "the burst should fuse into one forward"
        got = decode_embedding(body)
        assert got.shape == want.shape
        assert rel_diff(got, want) <= 1e-5
        assert sum(item["tokens"] for item in body["items"]) == got.shape[0]


def test_batch_never_exceeds_max_batch_size(batching_server):
    bodies = [{"req_id": f"cap-{i}", "modality": "image", "mm_items": [image_b64(56, 56, seed=i)]}
              for i in range(40)]
    responses = asyncio.run(post_many(batching_server.url, bodies))
    sizes = sorted(r.json()["batch_size"] for r in responses)
    assert all(r.status_code == 200 for r in responses)
    assert max(sizes) == 32 and sizes.count(32) == 32 and sizes.count(8) == 8


def test_bad_requests_fail_alone_in_a_burst(batching_server, reference):
    good_items = [[image_b64(56 + 14 * i, 56, seed=200 + i)] for i in range(8)]
    truncated = base64.b64encode(png_bytes(64, 64)[:60]).decode()
    bad = [
        ({"req_id": "bad-b64", "modality": "image", "mm_items": ["!!notbase64!!"]}, "mm_items[0]"),
        ({"req_id": "bad-trunc", "modality": "image", "mm_items": [image_b64(56, 56), truncated]}, "mm_items[1]"),
        ({"req_id": "bad-text", "modality": "image", "mm_items": [base64.b64encode(b"hello").decode()]},
         "mm_items[0]"),
        ({"req_id": "bad-modality", "modality": "smell", "mm_items": [image_b64(56, 56)]}, "modality"),
        ({"req_id": "bad-audio", "modality": "audio", "mm_items": [image_b64(56, 56)]}, "audio"),
        ({"req_id": "bad-empty", "modality": "image", "mm_items": []}, "mm_items"),
        ({"modality": "image", "mm_items": [image_b64(56, 56)]}, "req_id"),
        ({"req_id": "bad-part", "modality": "image", "mm_items": [image_b64(56, 56)], "num_parts": 2,
          "part_idx": 2}, "part_idx"),
        ({"req_id": "bad-type", "modality": "image", "mm_items": [42]}, "mm_items[0]"),
        ({"req_id": "bad-aspect", "modality": "image", "mm_items": [image_b64(1000, 2)]}, "mm_items[0]"),
        ({"req_id": "bad-scheme", "modality": "image", "mm_items": ["ftp://127.0.0.1/x.png"]}, "mm_items[0]"),
    ]
    bodies = [{"req_id": f"good-{i}", "modality": "image", "mm_items": items, "return_embedding": True}
              for i, items in enumerate(good_items)]
    bodies += [body for body, _ in bad]
    responses = asyncio.run(post_many(batching_server.url, bodies))
    for response, items in zip(responses[:8], good_items):
        assert response.status_code == 200, response.text
        assert rel_diff(decode_embedding(response.json()), encode_alone(reference, items)) <= 1e-5
    for response, (body, needle) in zip(responses[8:], bad):
        assert response.status_code == 400, (body.get("req_id"), response.text)
        error = response.json()
        assert error["status"] == "error" and needle in error["message"], error
        assert error["req_id"] == body.get("req_id")


def test_malformed_bodies_are_400_with_a_message(default_server):
    for raw in (b"", b"{not json", b"[1, 2]", b'"text"', b"[" * 100_000 + b"]" * 100_000):
        response = httpx.post(default_server.url + "/encode", content=raw,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400, raw[:20]
        assert response.json()["status"] == "error" and response.json()["message"]


# The in-flight paths (409, 503, 504, 413, disconnects, the hard timeout) are asserted in-process,
# on a fake clock, in tests/service/test_service.py.


# --- under load ---------------------------------------------------------------------------------

def test_health_answers_during_a_burst_and_performance_reports_it(default_server):
    async def scenario():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
            burst = [asyncio.ensure_future(client.post(default_server.url + "/encode", json={
                "req_id": f"load-{i}", "modality": "image", "mm_items": [image_b64(112, 112, seed=i)]}))
                for i in range(64)]
            await asyncio.sleep(0.05)
            started = time.monotonic()
            health = await client.get(default_server.url + "/health")
            health_s = time.monotonic() - started
            return health, health_s, await asyncio.gather(*burst)

    health, health_s, responses = asyncio.run(scenario())
    assert health.status_code == 200
    assert health_s < 2.0, f"/health took {health_s:.2f} s under load"
    assert all(r.status_code == 200 for r in responses)
    assert max(r.json()["batch_size"] for r in responses) > 1, "a busy encoder should fuse the queue"
    perf = httpx.get(default_server.url + "/v1/performance").json()
    assert perf["requests"] >= 64 and perf["throughput_rps"] > 0
    assert set(perf["latency_ms"]) == {"avg", "p50", "p99"}
    assert 0 < perf["batching_efficiency"] <= 1 and perf["avg_batch_size"] >= 1
    assert perf["queue_depth"] == 0


def test_one_batch_in_flight_where_the_forward_leaves_no_core_to_prepare_on():
    """On one core with one torch thread, a second batch in flight would only split the queue: the server keeps
    one (`/server_info`'s `batches_in_flight_max`); on this machine's cores, what the rule says for them."""
    import os

    from encode_server.ops.cores import usable_cores
    from encode_server.scheduling.scheduler import batches_in_flight

    own, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {min(own)})  # the server's threads inherit it
        with InProcessServer() as server:
            assert httpx.get(f"{server.url}/server_info").json()["batches_in_flight_max"] == 1
        os.sched_setaffinity(0, own)
        with InProcessServer() as server:
            assert httpx.get(f"{server.url}/server_info").json()["batches_in_flight_max"] == batches_in_flight(
                False, 1, usable_cores())
    finally:
        os.sched_setaffinity(0, own)
        torch.set_num_threads(threads)
