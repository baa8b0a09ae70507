"""The embedding cache through a real server: repeated and concurrent identical items cost one forward,
a request encodes only the items the cache lacks, cached rows are bit-identical to a fresh encode for
every built-in family (fused batches included), the memory bound holds under a stream of unique
items, a failed request or one that leaves never poisons the cache, deadlines inside the batching window
are served in the default configuration, and the cache is visible in responses,
ZMQ headers, /metrics and /v1/performance."""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest
import soundfile
import torch

from encode_server.bench.workloads import png_with_nonce
from encode_server.delivery.native_wire import NativeWire
from encode_server.models import ItemLayout, load_adapter
from encode_server.records import EncodedPart, PartMeta
from tests.support.helpers import InProcessServer, ServerProcess, png_bytes

CACHED = ("--cache-bytes", "64MiB", "--health-probe-interval-s", "3600")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def embedding_of(body: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"])


def item_rows(body: dict) -> list[np.ndarray]:
    """The response's embedding split per item."""
    tokens = [item["tokens"] for item in body["items"]]
    return np.split(embedding_of(body), np.cumsum(tokens)[:-1])


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(url + "/encode", json=body) for body in bodies))


def encode(server: ServerProcess, req_id: str, items: list, modality: str = "image", **extra) -> httpx.Response:
    return httpx.post(server.url + "/encode", timeout=120, json={
        "req_id": req_id, "modality": modality, "mm_items": items, "return_embedding": True, **extra})


def forwards(server: ServerProcess, modality: str = "image") -> tuple[float, float]:
    """(forwards so far, tokens encoded so far) for a modality."""
    return (server.metric("encoder_batch_tokens_count", modality=modality),
            server.metric("encoder_batch_tokens_sum", modality=modality))


@pytest.fixture(scope="module")
def server():
    # Requests arriving within 150 ms of each other fuse into one forward.
    with InProcessServer(*CACHED, "--max-wait-ms", "150") as server:
        yield server


# --- one forward for many requests ------------------------------------------------------------------


def test_concurrent_identical_items_cost_one_forward(server):
    image = b64(png_bytes(84, 56, seed=101))
    count_before, tokens_before = forwards(server)
    responses = asyncio.run(post_all(server.url, [
        {"req_id": f"same-{i}", "modality": "image", "mm_items": [image], "return_embedding": True}
        for i in range(12)]))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    bodies = [r.json() for r in responses]
    count_after, tokens_after = forwards(server)
    assert count_after - count_before == 1
    assert tokens_after - tokens_before == bodies[0]["items"][0]["tokens"] == 6
    assert sorted(body["items"][0]["cached"] for body in bodies) == [False] + [True] * 11
    first = embedding_of(bodies[0])
    assert all(np.array_equal(embedding_of(body), first) for body in bodies)
    assert all(set(body["timings_ms"]) == {"queue", "preprocess", "encode", "transfer"} for body in bodies)

    for index in range(3):  # and repeated later: no forward at all
        again = encode(server, f"same-again-{index}", [image]).json()
        assert again["items"][0]["cached"] and np.array_equal(embedding_of(again), first)
        assert again["batch_size"] == 0  # no forward served it
    assert forwards(server)[0] == count_after


def test_a_request_with_three_items_of_which_two_are_cached_encodes_one(server):
    a, b, c = (b64(png_bytes(56, 56 + 28 * i, seed=200 + i)) for i in range(3))
    first = encode(server, "three-first", [a, c]).json()
    count_before, tokens_before = forwards(server)
    body = encode(server, "three", [a, b, c]).json()
    count_after, tokens_after = forwards(server)
    assert [item["cached"] for item in body["items"]] == [True, False, True]
    assert count_after - count_before == 1 and tokens_after - tokens_before == body["items"][1]["tokens"]
    rows, earlier = item_rows(body), item_rows(first)
    assert np.array_equal(rows[0], earlier[0]) and np.array_equal(rows[2], earlier[1])
    assert body["embedding_shape"][0] == sum(item["tokens"] for item in body["items"])


# --- bit-identical to a fresh encode ----------------------------------------------------------------


def check_bit_identical(server: ServerProcess, modality: str, items: list[str], fresh_copies: list[str]):
    """Encode `items` in fused requests, ask again (cached, in another order and grouping), and encode
    `fresh_copies` (the same media in different bytes: the cache cannot know them) alone, twice each."""
    bodies = [{"req_id": f"{modality}-fused-{i}", "modality": modality, "mm_items": items[i:i + 2],
               "return_embedding": True} for i in range(0, len(items), 2)]
    fused = [r.json() for r in asyncio.run(post_all(server.url, bodies))]
    assert all("items" in body for body in fused), fused
    assert max(body["batch_size"] for body in fused) > 1, "the first encodes were not fused"
    first = [rows for body in fused for rows in item_rows(body)]
    assert not any(item["cached"] for body in fused for item in body["items"])

    again = encode(server, f"{modality}-again", list(reversed(items)), modality=modality).json()
    assert all(item["cached"] for item in again["items"])
    for rows, earlier in zip(item_rows(again), reversed(first)):
        assert rows.dtype == earlier.dtype and np.array_equal(rows, earlier)  # bit for bit

    alone = encode(server, f"{modality}-alone", [items[0]], modality=modality).json()
    assert alone["items"][0]["cached"]
    fresh = encode(server, f"{modality}-fresh", [fresh_copies[0]], modality=modality).json()
    assert not fresh["items"][0]["cached"]
    # A fresh encode of the same media alone equals the cached rows (first encoded in a fused batch)
    # up to float rounding, and two fresh solo encodes are bit-identical to each other.
    np.testing.assert_allclose(embedding_of(fresh), embedding_of(alone), rtol=1e-5, atol=1e-6)
    fresh_again = encode(server, f"{modality}-fresh-2", [fresh_copies[1]], modality=modality).json()
    assert not fresh_again["items"][0]["cached"]
    assert np.array_equal(embedding_of(fresh_again), embedding_of(fresh))
    cached_fresh = encode(server, f"{modality}-fresh-3", [fresh_copies[0]], modality=modality).json()
    assert cached_fresh["items"][0]["cached"] and np.array_equal(embedding_of(cached_fresh), embedding_of(fresh))


def image_items(seed: int, sizes: list[tuple[int, int]]) -> tuple[list[str], list[str]]:
    pngs = [png_bytes(w, h, seed=seed + i) for i, (w, h) in enumerate(sizes)]
    return [b64(p) for p in pngs], [b64(png_with_nonce(pngs[0], f"copy-{k}")) for k in range(2)]


def test_qwen_images_cached_rows_are_bit_identical_to_a_fresh_encode(server):
    items, copies = image_items(300, [(56, 84), (112, 56), (70, 70), (140, 98), (56, 56), (84, 84)])
    check_bit_identical(server, "image", items, copies)


def test_qwen_video_frames_cached_rows_are_bit_identical_to_a_fresh_encode(server):
    frames = [[png_bytes(56, 56, seed=400 + 10 * v + f) for f in range(2 + v)] for v in range(3)]
    items = [{"frames": [b64(f) for f in clip]} for clip in frames]
    copies = [{"frames": [b64(png_with_nonce(f, f"copy-{k}")) for f in frames[0]]} for k in range(2)]
    # Videos run one at a time (never fused): the check still covers their rows and layouts.
    responses = [encode(server, f"video-{i}", [item], modality="video").json() for i, item in enumerate(items)]
    again = encode(server, "video-again", items, modality="video").json()
    assert [item["cached"] for item in again["items"]] == [True, True, True]
    assert all(np.array_equal(rows, embedding_of(body)) for rows, body in zip(item_rows(again), responses))
    fresh = [encode(server, f"video-fresh-{k}", [copies[k]], modality="video").json() for k in range(2)]
    assert not fresh[0]["items"][0]["cached"] and not fresh[1]["items"][0]["cached"]
    assert np.array_equal(embedding_of(fresh[0]), embedding_of(responses[0]))
    assert np.array_equal(embedding_of(fresh[1]), embedding_of(responses[0]))


def wav_and_flac(seconds: float, seed: int) -> tuple[bytes, bytes, bytes]:
    """A clip as 16-bit WAV, and the same samples as FLAC and as WAV with a different header."""
    wave = (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 3000).astype(np.int16)
    out = []
    for fmt, subtype in (("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("WAVEX", "PCM_16")):
        buffer = io.BytesIO()
        soundfile.write(buffer, wave, 16000, format=fmt, subtype=subtype)
        out.append(buffer.getvalue())
    return out[0], out[1], out[2]


@pytest.mark.parametrize("model", ["tiny-internvl", "tiny-qwen2-audio", "tiny-qwen3-vl", "tiny-glm4v"])
def test_other_families_cached_rows_are_bit_identical_to_a_fresh_encode(model):
    with InProcessServer(*CACHED, "--model", model, "--max-wait-ms", "150") as family_server:
        if model == "tiny-internvl":
            items, copies = image_items(500, [(56, 56), (112, 56), (168, 56), (56, 112), (100, 60), (64, 64)])
            check_bit_identical(family_server, "image", items, copies)
        elif model != "tiny-qwen2-audio":
            items, copies = image_items(550, [(64, 64), (128, 64), (96, 96), (64, 128), (160, 96), (96, 64)])
            check_bit_identical(family_server, "image", items, copies)
        else:
            clips = [wav_and_flac(0.5 + 0.3 * i, seed=600 + i) for i in range(4)]
            items = [b64(wav) for wav, _, _ in clips]
            check_bit_identical(family_server, "audio", items, [b64(clips[0][1]), b64(clips[0][2])])


# --- failures, deadlines, memory ---------------------------------------------------------------------


def test_a_failed_request_is_never_cached(server):
    good, bad = b64(png_bytes(56, 70, seed=700)), b64(b"\x89PNG\r\n\x1a\n but not really an image")
    failed = encode(server, "fails", [good, bad])
    assert failed.status_code == 400 and "mm_items[1]" in failed.json()["message"]
    assert failed.json()["req_id"] == "fails"
    entries = server.metric("encoder_cache_entries")
    again = encode(server, "fails-again", [bad])
    assert again.status_code == 400 and "mm_items[0]" in again.json()["message"]
    alone = encode(server, "good-alone", [good]).json()
    assert alone["items"][0]["cached"] is False  # the failed request's good item was not kept either
    assert server.metric("encoder_cache_entries") == entries + 1


def test_concurrent_requests_sharing_a_bad_item_each_get_a_400_naming_their_own_item(server):
    bad = b64(b"GIF89a" + b"\x00" * 40)
    responses = asyncio.run(post_all(server.url, [
        {"req_id": "bad-a", "modality": "image", "mm_items": [b64(png_bytes(56, 56, seed=701)), bad]},
        {"req_id": "bad-b", "modality": "image", "mm_items": [bad]},
        {"req_id": "bad-c", "modality": "image", "mm_items": [bad, bad, b64(png_bytes(56, 56, seed=702))]}]))
    messages = {r.json()["req_id"]: r.json()["message"] for r in responses}
    assert all(r.status_code == 400 for r in responses)
    assert messages["bad-a"].startswith("mm_items[1]") and messages["bad-b"].startswith("mm_items[0]")
    assert messages["bad-c"].startswith("mm_items[0]")


def test_performance_and_metrics_show_the_cache(server):
    image = b64(png_bytes(56, 56, seed=800))
    encode(server, "perf-1", [image])
    encode(server, "perf-2", [image, image])
    performance = httpx.get(server.url + "/v1/performance").json()
    cache = performance["cache"]
    assert cache["enabled"] and cache["capacity_bytes"] == 64 << 20 and cache["entries"] >= 1
    assert 0 < cache["hit_rate"] < 1 and cache["hits"] >= 2 and 0 < performance["cache_hit_rate"] < 1
    assert server.metric("encoder_cache_hits_total") == cache["hits"]
    assert server.metric("encoder_cache_misses_total") == cache["misses"]
    assert server.metric("encoder_cache_bytes") == cache["bytes"] > 0
    assert server.metric("encoder_cache_evictions_total") == 0


def test_native_wire_headers_carry_the_cached_flags():
    adapter = load_adapter("tiny-internvl")
    part = EncodedPart(embedding=torch.zeros(18, adapter.info.hidden_size), batch_size=1, cached=(True, False),
                       layouts=(ItemLayout(9, (1, 6, 6)), ItemLayout(9, (1, 6, 6))))
    header = NativeWire(adapter).header(PartMeta("r", 0, 1, "image"), part)
    assert [item["cached"] for item in header.items] == [True, False]
    plain = EncodedPart(embedding=torch.zeros(9, 64), layouts=(ItemLayout(9, (1, 6, 6)),), batch_size=1)
    assert plain.items_json() == [{"tokens": 9, "grid_thw": [1, 6, 6]}]  # the cache was not asked


@pytest.fixture(scope="module")
def small_holding_server():
    # Room for 6 entries of a 112x112 image (16 rows x 128 floats + overhead); lone requests wait 0.6 s.
    capacity = 6 * (16 * 128 * 4 + 1024)
    with InProcessServer("--cache-bytes", str(capacity), "--health-probe-interval-s", "3600", "--max-wait-ms", "600",
                         "--min-batch-size", "8", "--hard-timeout-additional-s", "0.4") as server:
        yield server, capacity


def test_the_memory_bound_holds_under_a_stream_of_unique_items(small_holding_server):
    server, capacity = small_holding_server
    for wave in range(5):
        bodies = [{"req_id": f"stream-{wave}-{i}", "modality": "image",
                   "mm_items": [b64(png_bytes(112, 112, seed=900 + 8 * wave + i))]} for i in range(8)]
        responses = asyncio.run(post_all(server.url, bodies))
        assert all(r.status_code == 200 and not r.json()["items"][0]["cached"] for r in responses)
        assert 0 < server.metric("encoder_cache_bytes") <= capacity
    assert server.metric("encoder_cache_entries") == 6
    assert server.metric("encoder_cache_evictions_total") == 40 - 6
    assert server.metric("encoder_cache_misses_total") == 40


def test_an_owner_that_leaves_does_not_fail_the_requests_waiting_for_the_same_item(small_holding_server):
    """The owner disconnects while its encode is held (an owner with a deadline inside the window would be
    promoted and served now that deadlines reach the scheduler through the cache, so it leaves by hanging up)."""
    server, _ = small_holding_server
    image = [b64(png_bytes(56, 56, seed=990))]
    count_before, _ = forwards(server)
    cancelled_before = server.metric("encoder_requests_total", modality="image", status="cancelled")

    async def owner_then_waiter():
        async with httpx.AsyncClient(timeout=60) as client:
            owner = asyncio.create_task(client.post(server.url + "/encode", json={
                "req_id": "owner", "modality": "image", "mm_items": image}))
            await asyncio.sleep(0.1)
            waiter = asyncio.create_task(client.post(server.url + "/encode", json={
                "req_id": "waiter", "modality": "image", "mm_items": image, "return_embedding": True}))
            await asyncio.sleep(0.2)
            owner.cancel()  # closes its connection: the server sees the owner leave
            return await asyncio.gather(owner, return_exceptions=True), await waiter

    started = time.monotonic()
    (owner,), waiter = asyncio.run(owner_then_waiter())
    assert isinstance(owner, asyncio.CancelledError)
    assert waiter.status_code == 200 and waiter.json()["items"][0]["cached"] is True, waiter.text
    assert time.monotonic() - started >= 0.9  # it waited for the held batch, long after the owner left
    assert forwards(server)[0] - count_before == 1
    assert server.metric("encoder_requests_total", modality="image", status="cancelled") == cancelled_before + 1
    later = encode(server, "after-timeout", image).json()  # the result was kept, and it is the right one
    assert later["items"][0]["cached"] and np.array_equal(embedding_of(later), embedding_of(waiter.json()))


def test_tensor_parallel_ranks_only_ever_see_the_missing_items():
    """The cache lives on rank 0: a hit never reaches the ranks, a miss reaches all of them (the ranks'
    layout agreement would fail the batch if they were sent different items)."""
    a, b = b64(png_bytes(56, 84, seed=1000)), b64(png_bytes(84, 56, seed=1001))
    reference = load_adapter("tiny-qwen2.5-vl", "cpu", "float32")
    with ServerProcess(*CACHED, "--tp-size", "2") as tp_server:
        first = encode(tp_server, "tp-first", [a]).json()
        count_before, tokens_before = forwards(tp_server)
        body = encode(tp_server, "tp-second", [a, b]).json()
        count_after, tokens_after = forwards(tp_server)
        assert [item["cached"] for item in body["items"]] == [True, False]
        assert count_after - count_before == 1 and tokens_after - tokens_before == body["items"][1]["tokens"]
        rows = item_rows(body)
        assert np.array_equal(rows[0], embedding_of(first))
        from PIL import Image

        expected = reference.forward(reference.processor.preprocess("image",
                                                                    [Image.open(io.BytesIO(base64.b64decode(b)))
                                                                    .convert("RGB")])).numpy()
        assert np.abs(rows[1] - expected).max() <= 1e-5 * np.abs(expected).max()
        assert httpx.get(tp_server.url + "/health").status_code == 200


def test_deadlines_inside_the_batching_window_are_served_in_the_default_configuration():
    """A new user's server (the default cache) that waits 300 ms for 4 requests: a lone request that may
    wait only 0.2 or 0.3 s is promoted before its deadline, not failed 504 (with the cache off the same
    holds: `tests/service/test_service.py` runs both configurations in-process)."""
    flags = ("--max-wait-ms", "300", "--min-batch-size", "4", "--hard-timeout-additional-s", "0.6",
             "--max-batch-size", "8", "--health-probe-interval-s", "3600")
    outcomes = []
    with InProcessServer(*flags, env={"ENCODER_CACHE_BYTES": "auto"}) as server:
        for attempt, timeout_s in enumerate((0.2, 0.2, 0.3)):
            response = encode(server, f"hurried-{attempt}", [b64(png_bytes(56, 56, seed=100 + attempt))],
                              timeout_s=timeout_s)
            queued_ms = response.json().get("timings_ms", {}).get("queue") if response.status_code == 200 else None
            outcomes.append((response.status_code, queued_ms, timeout_s))
        assert server.metric("encoder_cache_misses_total") == 3
    # 200 means answered within the deadline (the server answers 504 at it); the queue wait shows it was
    # promoted before the deadline rather than held for the 300 ms window
    assert all(status == 200 and queued_ms < 1000 * timeout_s for status, queued_ms, timeout_s in outcomes), outcomes
