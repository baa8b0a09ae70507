"""The benchmark's workloads: chat conversations re-send earlier turns' images with Zipf popularity;
the unique workload never repeats an image; nonce-tagged copies decode to the same pixels."""

from __future__ import annotations

import base64
import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from encode_server.bench.__main__ import point_metrics, server_flags
from encode_server.bench.workloads import ChatWorkload, UniqueWorkload, make_workload, png_with_nonce
from tests.support.helpers import png_bytes

pytestmark = pytest.mark.quick


def pixels(item: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item))).convert("RGB"))


def test_a_nonce_changes_the_bytes_but_not_the_pixels():
    png = png_bytes(32, 24, seed=3)
    tagged = png_with_nonce(png, "n-1")
    assert tagged != png and tagged != png_with_nonce(png, "n-2")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(tagged))), np.asarray(Image.open(io.BytesIO(png))))
    with pytest.raises(ValueError):
        png_with_nonce(b"not a png", "x")


def test_chat_turns_resend_the_earlier_turns_images_and_popular_conversations_repeat():
    workload = ChatWorkload(image_size=28, conversations=64, zipf_a=1.1)
    requests = workload.requests(400)
    assert all(1 <= len(items) <= 4 for items in requests)
    seen_by_first: dict[str, list[list[str]]] = {}
    for items in requests:
        seen_by_first.setdefault(items[0], []).append(items)
    for turns in seen_by_first.values():  # one conversation: each turn extends the previous one
        for previous, current in zip(turns, turns[1:]):
            if len(current) > len(previous):
                assert current[: len(previous)] == previous
    counts = Counter(item for items in requests for item in items)
    sent = sum(counts.values())
    assert 1 - len(counts) / sent > 0.6, "most images sent in chat traffic are repeats"
    popularity = sorted((len(turns) for turns in seen_by_first.values()), reverse=True)
    assert popularity[0] > 5 * popularity[len(popularity) // 2], "conversations are not Zipf-like"


def test_chat_is_deterministic_so_every_configuration_sees_the_same_requests():
    assert ChatWorkload(28, 32).requests(50) == ChatWorkload(28, 32).requests(50)


def test_unique_never_repeats_an_image_and_keeps_the_chat_shape():
    workload = UniqueWorkload(image_size=28)
    requests = workload.requests(200) + workload.requests(8)
    items = [item for request in requests for item in request]
    assert len(set(items)) == len(items)
    assert {len(request) for request in requests} == {1, 2, 3, 4}
    assert np.mean([len(request) for request in requests[:200]]) == 2.5
    assert np.array_equal(pixels(items[0]), pixels(items[16]))  # same pool picture, different bytes


def test_chat_and_unique_are_images_only():
    with pytest.raises(ValueError):
        make_workload("chat", "audio", 56, 1.0)
    assert len(make_workload("single", "audio", 56, 0.2).requests(3)) == 3


def test_cache_configurations_differ_only_in_the_cache_and_batching_configs_run_without_it():
    class Args:
        model, max_batch_size, max_wait_ms, cache_bytes = "tiny-qwen2.5-vl", 32, 0.0, "64MiB"

    assert server_flags("cache-on", Args)[-2:] == ["--cache-bytes", "64MiB"]
    assert server_flags("cache-off", Args)[-2:] == ["--cache-bytes", "0"]
    assert server_flags("cache-on", Args)[:-1] == server_flags("cache-off", Args)[:-1] == server_flags("on", Args)[:-1]
    assert "false" in server_flags("off", Args) and server_flags("off", Args)[-1] == "0"


def test_point_metrics_are_deltas_of_the_servers_counters():
    before = {"encoder_cache_hits_total": 10, "encoder_cache_misses_total": 10, "encoder_batch_tokens_sum": 100}
    after = {"encoder_cache_hits_total": 40, "encoder_cache_misses_total": 20, "encoder_batch_tokens_sum": 140,
             "encoder_forward_seconds_count": 3, "encoder_cache_bytes": 2**20}
    metrics = point_metrics(before, after, pid=None)
    assert metrics["hit_rate"] == 0.75 and metrics["tokens_encoded"] == 40 and metrics["forwards"] == 3
    assert metrics["cache_mib"] == 1.0 and metrics["rss_mib"] is None
    assert point_metrics({}, {}, pid=None)["hit_rate"] is None


def test_single_sends_a_unique_copy_per_request_unless_told_to_repeat():
    """The default single workload never repeats an item's bytes (so a server's cache cannot answer it), yet
    decodes to the same 32 pictures or clips; `repeat` cycles through the 32 items themselves."""
    import soundfile

    distinct = make_workload("single", "image", 28, 1.0).requests(70)
    items = [item for request in distinct for item in request]
    assert len(set(items)) == 70
    assert np.array_equal(pixels(items[0]), pixels(items[32])) and items[0] != items[32]
    repeated = make_workload("single", "image", 28, 1.0, repeat=True).requests(70)
    assert len({item for request in repeated for item in request}) == 32
    clips = [request[0] for request in make_workload("single", "audio", 28, 0.2).requests(33)]
    assert len(set(clips)) == 33
    decoded = [soundfile.read(io.BytesIO(base64.b64decode(clip)), dtype="float32")[0] for clip in (clips[0], clips[32])]
    assert np.array_equal(*decoded)


def test_a_salt_makes_two_runs_send_different_bytes():
    first = make_workload("unique", "image", 28, 1.0, salt="a").requests(5)
    assert first == make_workload("unique", "image", 28, 1.0, salt="a").requests(5)
    assert not {i for r in first for i in r} & {i for r in make_workload("unique", "image", 28, 1.0, salt="b")
                                                 .requests(5) for i in r}
    assert make_workload("single", "image", 28, 1.0, salt="a").requests(3) != \
        make_workload("single", "image", 28, 1.0, salt="b").requests(3)


def test_wav_nonce_keeps_the_samples():
    import soundfile

    from encode_server.bench.workloads import wav_with_nonce

    clip = io.BytesIO()
    soundfile.write(clip, np.linspace(-0.5, 0.5, 800, dtype=np.float32), 16000, format="WAV")
    tagged = wav_with_nonce(clip.getvalue(), "odd-nonce")
    assert tagged != clip.getvalue()
    assert np.array_equal(soundfile.read(io.BytesIO(tagged))[0], soundfile.read(io.BytesIO(clip.getvalue()))[0])
    with pytest.raises(ValueError):
        wav_with_nonce(b"not a wav", "x")
