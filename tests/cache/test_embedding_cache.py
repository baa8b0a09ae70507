"""The embedding cache in-process, with fake encoders: hits and misses, LRU order, the byte bound,
in-flight deduplication (a cancelled owner loses nothing for its waiters), failures never cached,
keys and model fingerprints."""

from __future__ import annotations

import asyncio
import copy
import gc
import weakref

import pytest
import torch

from encode_server.cache.embedding_cache import (
    ENTRY_OVERHEAD_BYTES,
    CachedItem,
    EmbeddingCache,
    ItemKeys,
    adapter_fingerprint,
)
from encode_server.models import ItemLayout, load_adapter
from encode_server.ops.memory import default_cache_bytes, parse_byte_size, parse_cache_bytes
from encode_server.scheduling.demand import Demand, SharedDemand, Urgency
from tests.support.fakes import settle

pytestmark = pytest.mark.quick

DIM = 8


def item_for(key: str, tokens: int = 4) -> CachedItem:
    """Rows that depend on the key only, as an encoder's would."""
    seed = sum(key.encode())
    rows = torch.arange(tokens * DIM, dtype=torch.float32).reshape(tokens, DIM) + seed
    return CachedItem(rows, ItemLayout(tokens=tokens, grid_thw=(1, 2, tokens // 2 or 1)))


class FakeEncoder:
    """Counts its computations and the items it was asked for; optionally waits for a gate or fails."""

    def __init__(self, tokens: int = 4, gate: asyncio.Event | None = None, error: Exception | None = None):
        self.tokens, self.gate, self.error = tokens, gate, error
        self.calls: list[list[str]] = []
        self.demands: list[SharedDemand] = []  # each computation's waiters
        self.cancelled = 0

    def for_keys(self, keys: list[str]):
        async def compute(positions: list[int], demand: SharedDemand) -> list[CachedItem]:
            self.calls.append([keys[p] for p in positions])
            self.demands.append(demand)
            try:
                if self.gate is not None:
                    await self.gate.wait()
                else:
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            if self.error is not None:
                raise self.error
            return [item_for(keys[p], self.tokens) for p in positions]
        return compute

    @property
    def computed_items(self) -> int:
        return sum(len(call) for call in self.calls)


async def resolve(cache: EmbeddingCache, encoder: FakeEncoder, keys: list[str], demand: Demand | None = None):
    return await cache.resolve(keys, encoder.for_keys(keys), demand)


# --- hits, misses, order --------------------------------------------------------------------------


async def test_a_miss_computes_and_a_repeat_is_a_hit_with_the_same_rows():
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder()
    first = await resolve(cache, encoder, ["a", "b"])
    second = await resolve(cache, encoder, ["a", "b"])
    assert encoder.calls == [["a", "b"]]
    assert [r.cached for r in first] == [False, False] and [r.cached for r in second] == [True, True]
    for fresh, again in zip(first, second):
        assert torch.equal(fresh.item.rows, again.item.rows) and fresh.item.layout == again.item.layout
    assert (cache.stats.hits, cache.stats.misses, cache.stats.hit_rate) == (2, 2, 0.5)


async def test_only_the_missing_items_are_computed_and_results_keep_item_order():
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder()
    await resolve(cache, encoder, ["x", "z"])
    results = await resolve(cache, encoder, ["x", "y", "z"])
    assert encoder.calls[-1] == ["y"]
    assert [r.cached for r in results] == [True, False, True]
    for key, result in zip(["x", "y", "z"], results):
        assert torch.equal(result.item.rows, item_for(key).rows)


async def test_the_same_item_twice_in_one_call_is_computed_once():
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder()
    results = await resolve(cache, encoder, ["a", "b", "a"])
    assert encoder.calls == [["a", "b"]]
    assert [r.cached for r in results] == [False, False, True]
    assert results[0].item is results[2].item


async def test_least_recently_used_goes_first():
    size = item_for("a").nbytes
    cache, encoder = EmbeddingCache(3 * size), FakeEncoder()
    for key in "abc":
        await resolve(cache, encoder, [key])
    await resolve(cache, encoder, ["a"])  # a is now the most recently used; b the least
    await resolve(cache, encoder, ["d"])
    assert "b" not in cache and all(key in cache for key in "acd")
    assert cache.stats.evictions == 1 and cache.bytes_held == 3 * size


async def test_the_byte_bound_holds_under_a_stream_of_unique_items():
    capacity = 64 * 1024
    cache = EmbeddingCache(capacity)
    stored = 0
    for index in range(600):
        encoder = FakeEncoder(tokens=1 + index % 37)
        await resolve(cache, encoder, [f"unique-{index}"])
        stored += 1
        assert cache.bytes_held <= capacity
        assert cache.bytes_held == sum(cache.get(key).nbytes for key in list(cache._entries))
    assert cache.stats.misses == 600 and cache.stats.hits == 0
    assert cache.stats.evictions == stored - len(cache) > 400
    assert cache.bytes_held > capacity * 0.9  # it fills up rather than evicting too eagerly


async def test_an_item_larger_than_the_capacity_is_returned_but_not_stored():
    cache, encoder = EmbeddingCache(ENTRY_OVERHEAD_BYTES + 16), FakeEncoder(tokens=64)
    results = await resolve(cache, encoder, ["big"])
    assert results[0].item.rows.shape == (64, DIM)
    assert len(cache) == 0 and cache.bytes_held == 0


def test_cached_rows_own_their_storage_and_do_not_pin_the_batch():
    batch = torch.randn(1000, DIM)
    batch_ref = weakref.ref(batch)
    item = CachedItem.compact(batch[10:14], ItemLayout(4, (1, 2, 2)))
    assert item.rows.untyped_storage().nbytes() == 4 * DIM * 4
    assert item.rows.is_contiguous() and torch.equal(item.rows, batch[10:14])
    del batch
    gc.collect()
    assert batch_ref() is None, "the cached item keeps the whole batch tensor alive"
    assert item.nbytes == 4 * DIM * 4 + ENTRY_OVERHEAD_BYTES


async def test_capacity_zero_turns_caching_and_deduplication_off():
    cache, encoder = EmbeddingCache(0), FakeEncoder()
    assert not cache.enabled
    await resolve(cache, encoder, ["a", "a"])
    await resolve(cache, encoder, ["a"])
    assert encoder.calls == [["a", "a"], ["a"]]
    assert len(cache) == 0 and (cache.stats.hits, cache.stats.misses) == (0, 0)


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError):
        EmbeddingCache(-1)


# --- in-flight deduplication ----------------------------------------------------------------------


async def test_ten_concurrent_requests_for_one_item_share_one_computation():
    gate = asyncio.Event()
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=gate)
    tasks = [asyncio.create_task(resolve(cache, encoder, ["same"])) for _ in range(10)]
    await asyncio.sleep(0.01)
    assert cache.in_flight == 1 and len(encoder.calls) == 1
    gate.set()
    results = await asyncio.gather(*tasks)
    assert encoder.calls == [["same"]]
    assert sum(not r[0].cached for r in results) == 1
    assert all(r[0].item is results[0][0].item for r in results)
    assert (cache.stats.misses, cache.stats.hits, cache.stats.joined) == (1, 9, 9)
    assert cache.in_flight == 0 and "same" in cache


async def test_a_cancelled_owner_does_not_lose_the_computation_for_its_waiters():
    gate = asyncio.Event()
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=gate)
    owner = asyncio.create_task(resolve(cache, encoder, ["img", "own-only"]))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(resolve(cache, encoder, ["img"])) for _ in range(3)]
    await asyncio.sleep(0.01)
    owner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await owner
    await asyncio.sleep(0.01)
    assert encoder.cancelled == 0, "the computation was cancelled with its owner"
    gate.set()
    results = await asyncio.gather(*waiters)
    assert all(torch.equal(r[0].item.rows, item_for("img").rows) and r[0].cached for r in results)
    assert encoder.calls == [["img", "own-only"]]
    assert "img" in cache and "own-only" in cache  # the owner's other item was finished and kept too


async def test_a_waiter_timing_out_ends_only_itself():
    gate = asyncio.Event()
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=gate)
    owner = asyncio.create_task(resolve(cache, encoder, ["img"]))
    await asyncio.sleep(0)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(resolve(cache, encoder, ["img"]), 0.02)
    gate.set()
    assert not (await owner)[0].cached
    assert encoder.calls == [["img"]] and encoder.cancelled == 0


async def test_when_every_waiter_leaves_the_computation_is_cancelled_and_the_next_request_starts_afresh():
    gate = asyncio.Event()
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=gate)
    tasks = [asyncio.create_task(resolve(cache, encoder, ["img"])) for _ in range(3)]
    await asyncio.sleep(0.01)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.01)
    assert encoder.cancelled == 1 and cache.in_flight == 0 and "img" not in cache
    gate.set()
    again = await resolve(cache, encoder, ["img"])
    assert not again[0].cached and len(encoder.calls) == 2 and "img" in cache


async def test_a_caller_waits_for_others_items_and_computes_only_its_new_ones():
    gate = asyncio.Event()
    cache, first_encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=gate)
    first = asyncio.create_task(resolve(cache, first_encoder, ["a"]))
    await asyncio.sleep(0)
    second_encoder = FakeEncoder()
    second = asyncio.create_task(resolve(cache, second_encoder, ["a", "b"]))
    await asyncio.sleep(0.01)
    assert second_encoder.calls == [["b"]] and not second.done()  # b is done, a still in flight
    gate.set()
    results = await second
    assert [r.cached for r in results] == [True, False]
    assert (await first)[0].item is results[0].item


# --- failures -------------------------------------------------------------------------------------


async def test_a_failed_computation_is_not_cached_and_its_waiters_get_the_same_error():
    gate = asyncio.Event()
    error = ValueError("mm_items[0]: not a decodable image")
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=gate, error=error)
    tasks = [asyncio.create_task(resolve(cache, encoder, ["bad"])) for _ in range(5)]
    await asyncio.sleep(0.01)
    gate.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(outcome is error for outcome in outcomes)
    assert len(encoder.calls) == 1 and "bad" not in cache and cache.in_flight == 0 and cache.bytes_held == 0
    healthy = FakeEncoder()
    assert not (await resolve(cache, healthy, ["bad"]))[0].cached and healthy.calls == [["bad"]]


async def test_a_failure_of_one_item_fails_the_call_but_caches_nothing_of_that_computation():
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(error=RuntimeError("encoder failed"))
    with pytest.raises(RuntimeError, match="encoder failed"):
        await resolve(cache, encoder, ["a", "b"])
    assert len(cache) == 0


async def test_a_computation_returning_the_wrong_count_fails():
    cache = EmbeddingCache(1 << 20)

    async def short(positions, demand):
        return []

    with pytest.raises(RuntimeError, match="returned 0 items for 1"):
        await cache.resolve(["a"], short)
    assert "a" not in cache and cache.in_flight == 0


async def test_a_computation_is_ordered_by_its_most_urgent_waiter_and_lives_as_long_as_the_last():
    cache, gate = EmbeddingCache(1 << 20), asyncio.Event()
    encoder = FakeEncoder(gate=gate)
    heard: list[Urgency] = []
    owner = asyncio.create_task(resolve(cache, encoder, ["img"], Demand(deadline=50.0, priority=0)))
    await settle()
    [waiting] = encoder.demands
    assert waiting.urgency == Urgency(deadline=50.0, priority=0, expires=50.0)
    waiting.watch(heard.append)
    urgent = asyncio.create_task(resolve(cache, encoder, ["img"], Demand(deadline=10.0, priority=0)))
    important = asyncio.create_task(resolve(cache, encoder, ["img"], Demand(deadline=90.0, priority=3)))
    await settle()
    assert heard == [Urgency(10.0, 0, 50.0), Urgency(10.0, 3, 90.0)]
    urgent.cancel()  # the most urgent waiter leaves: the computation falls back, and goes on
    await settle()
    assert heard[-1] == Urgency(50.0, 3, 90.0) and encoder.cancelled == 0
    gate.set()
    assert [len(await task) for task in (owner, important)] == [1, 1]
    assert encoder.calls == [["img"]] and len(waiting) == 0


async def test_the_last_waiter_leaving_cancels_without_a_change_of_urgency():
    cache, encoder = EmbeddingCache(1 << 20), FakeEncoder(gate=asyncio.Event())
    heard: list[Urgency] = []
    only = asyncio.create_task(resolve(cache, encoder, ["img"], Demand(deadline=5.0)))
    await settle()
    encoder.demands[0].watch(heard.append)
    only.cancel()
    await settle()
    assert encoder.cancelled == 1 and heard == []


async def test_with_the_cache_off_the_callers_own_demand_reaches_the_computation():
    encoder = FakeEncoder()
    await resolve(EmbeddingCache(0), encoder, ["a"], Demand(deadline=7.0, priority=2))
    assert encoder.demands[0].urgency == Urgency(7.0, 2, 7.0)


# --- keys -----------------------------------------------------------------------------------------


def test_keys_depend_on_bytes_modality_model_and_decode_settings():
    keys = ItemKeys("model-a", {"video": {"fps": 2.0, "max_frames": 32}})
    png = b"\x89PNG fake bytes"
    assert keys.key("image", png) == keys.key("image", bytearray(png)) == keys.key("image", memoryview(png))
    assert len(keys.key("image", png)) == 32
    assert keys.key("image", png) != keys.key("image", png + b"\x00")
    assert keys.key("image", png) != keys.key("video", png)
    assert keys.key("image", png) != ItemKeys("model-b").key("image", png)
    assert keys.key("video", png) != ItemKeys("model-a", {"video": {"fps": 1.0, "max_frames": 32}}).key("video", png)
    assert keys.key("image", png) == ItemKeys("model-a", {"video": {"fps": 1.0}}).key("image", png)


def test_a_frame_list_never_collides_with_its_files_joined_or_split_differently():
    keys = ItemKeys("m")
    assert keys.key("video", [b"ab", b"c"]) != keys.key("video", [b"a", b"bc"])
    assert keys.key("video", [b"abc"]) != keys.key("video", b"abc")
    assert keys.key("video", [b"a", b"b"]) == keys.key("video", [b"a", b"b"])


# --- fingerprints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def internvl():
    return load_adapter("tiny-internvl")


def test_fingerprint_is_stable_across_loads_of_the_same_model(internvl):
    assert adapter_fingerprint(internvl) == adapter_fingerprint(load_adapter("tiny-internvl"))


def test_fingerprint_changes_with_a_processor_setting(internvl):
    changed = copy.deepcopy(internvl)
    changed.processor.image_processor.max_patches = 4
    assert adapter_fingerprint(changed) != adapter_fingerprint(internvl)


def test_fingerprint_changes_with_the_weights_dtype_and_family(internvl):
    changed = copy.deepcopy(internvl)
    with torch.no_grad():
        next(changed.encoder.parameters()).add_(1.0)
    assert adapter_fingerprint(changed) != adapter_fingerprint(internvl)
    assert adapter_fingerprint(load_adapter("tiny-internvl", dtype="bfloat16")) != adapter_fingerprint(internvl)
    assert adapter_fingerprint(load_adapter("tiny-qwen2-audio")) != adapter_fingerprint(internvl)


def test_fingerprint_sees_through_a_wrapping_adapter(internvl):
    class Wrapper:
        pass

    from encode_server.models import EncoderAdapter

    class Wrapping(EncoderAdapter):
        item_layout = preprocess = forward = sample_item = None

        def __init__(self, inner):
            self.inner, self.group = inner, Wrapper()

    changed = copy.deepcopy(internvl)
    changed.processor.image_processor.max_patches = 4
    assert adapter_fingerprint(Wrapping(internvl)) == adapter_fingerprint(Wrapping(load_adapter("tiny-internvl")))
    assert adapter_fingerprint(Wrapping(internvl)) != adapter_fingerprint(Wrapping(changed))


# --- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("1048576", 1 << 20), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                         ("64k", 64_000), ("0", 0), (" 2 GiB ", 2 << 30)])
def test_byte_sizes_read_like_an_operator_writes_them(text, value):
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("text", ["-1", "lots", "12 parsecs", ""])
def test_bad_byte_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_byte_size(text)


def test_auto_capacity_is_five_percent_of_memory_at_most_one_gib():
    assert parse_cache_bytes("AUTO") == "auto"
    assert default_cache_bytes(memory=8 << 30) == int(0.05 * (8 << 30))
    assert default_cache_bytes(memory=512 << 30) == 1 << 30
    assert 0 < default_cache_bytes() <= 1 << 30


@pytest.mark.parametrize("size", [0, 1, 2047, 2048, 4095, 9000, 64 * 1024, 64 * 1024 + 1, 200_000])
def test_keys_of_small_items_hashed_in_slices_are_the_one_update_digest(size):
    from blake3 import blake3

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    reference = blake3(derive_key_context="encode-server item key v2")
    for part in (b"model-a", b"image", b"{}"):
        reference.update(len(part).to_bytes(8, "little"))
        reference.update(part)
    reference.update(b"F" + size.to_bytes(8, "little"))
    reference.update(data)
    keys = ItemKeys("model-a")
    assert keys.key("image", data) == reference.digest()
    assert keys.key("image", bytearray(data)) == keys.key("image", memoryview(data)) == reference.digest()
