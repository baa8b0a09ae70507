"""The request path with the embedding cache: hash each item's bytes, take what the cache holds, share
what other requests are already encoding, and encode only the rest, in one job.

`CachedEncoding.encode` reads every item's bytes (URLs fetched, inline items un-base64'd) and hashes
them in the media pool, before any decoding; a hit skips decode, preprocessing and the forward. The
missing items' decode and encode run in the cache's shared computation, detached from the request that
started it, so a cancelled or timed-out caller never fails the others waiting for the same items. Rows
come back in item order.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from encode_server.cache.embedding_cache import CachedItem, EmbeddingCache, ItemKeys, adapter_fingerprint
from encode_server.cache.store_tier import StoreTier
from encode_server.media.decoding import MediaError, MediaLimits
from encode_server.media.loader import LoadedItem, MediaLoader, MediaSource, RawItem, each_in_order
from encode_server.models import EncoderAdapter
from encode_server.ops.memory import default_cache_bytes
from encode_server.ops.metrics import ServerMetrics
from encode_server.ops.settings import Settings
from encode_server.ops.tracing import CURRENT as CURRENT_TRACE
from encode_server.records import EncodedPart, EncodeError, LayoutsKnown, PartMeta, Timings
from encode_server.scheduling.demand import Demand, SharedDemand

#: (meta, decoded items, decode seconds, the demands of the requests waiting, who hears the layouts) -> the
#: job's rows, through the scheduler, which orders it by the most urgent of them and hears of joins and leaves.
SubmitJob = Callable[[PartMeta, list[LoadedItem], float, SharedDemand, LayoutsKnown | None], Awaitable[EncodedPart]]


class CachedEncoding:
    """Serves a part's items from the cache where it can, and encodes the rest as one job."""

    def __init__(self, cache: EmbeddingCache, keys: ItemKeys, media: MediaLoader,
                 describe: Callable[[str, Any], Any], metrics: ServerMetrics, submit: SubmitJob,
                 store: StoreTier | None = None, now: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.store = store  # the shared second tier (Mooncake Store), or None
        self.now = now  # the clock requests' deadlines are on
        self.item_keys = keys
        self.media = media
        self.describe = describe  # the adapter's `item_layout`
        self.metrics = metrics
        self.submit = submit

    async def encode(self, meta: PartMeta, sources: list[MediaSource], started: float,
                     demand: Demand | None = None, layouts_known: LayoutsKnown | None = None) -> EncodedPart:
        """Hash each item's bytes (before decoding), take what the cache holds, join identical items being
        encoded for other requests, and encode only the rest, in one job; rows come back in item order.

        The missing items' decode and encode run in the cache's shared computation, detached from this
        request: if it is cancelled or times out, requests waiting for the same items still get them.
        Its place in the scheduler's queue follows the most urgent request waiting for it (`demand`:
        this request's deadline and priority). `layouts_known` hears the layouts when that job holds every
        item of the part (before its forward); with hits, or items joined from other requests, it does not.
        """
        read = await self.media.read(meta.modality, sources, functools.partial(self.item_keys.key, meta.modality),
                                     self.describe, self.cache.probably_holds)
        read_s = time.perf_counter() - started
        own: list[EncodedPart] = []
        from_store: set[Any] = set()  # keys this request's computation found in the shared tier

        async def compute(positions: list[int], waiting: SharedDemand) -> list[CachedItem]:
            items = [read[position] for position in positions]
            found: list[CachedItem | None] = [None] * len(items)
            if self.store is not None:
                found = await self.store.lookup(meta.modality, [item.digest.hex() for item in items],
                                                _store_timeout(self.store, waiting, self.now()))
                from_store.update(item.digest for item, hit in zip(items, found) if hit is not None)
            missing = [index for index, hit in enumerate(found) if hit is None]
            if not missing:
                return found
            whole = len(missing) == len(read)  # only a job of all the part's items gives its layouts
            part = await self._encode_missing(meta, [items[index] for index in missing], waiting,
                                              layouts_known if whole else None)
            own.append(part)
            rows = torch.split(part.embedding, [layout.tokens for layout in part.layouts])
            for index, item_rows, layout in zip(missing, rows, part.layouts):
                found[index] = CachedItem.compact(item_rows, layout)
                if self.store is not None:
                    self.store.publish(items[index].digest.hex(), found[index].rows, layout)
            return found

        try:
            resolved = await self.cache.resolve([item.digest for item in read], compute, demand or Demand())
        except MediaError as exc:  # an item's decode failed, maybe in another request's computation
            raise EncodeError(400, _relocated(exc, read), meta.req_id) from None
        except EncodeError as exc:  # the encoder failed; the error may come from another request's computation
            raise EncodeError(exc.status, exc.message, meta.req_id, exc.headers) from None
        rows = [result.item.rows for result in resolved]
        tiers = tuple("store" if item.digest in from_store else "local" if result.cached else None
                      for item, result in zip(read, resolved))
        part = own[0] if own else None
        timings = part.timings if part else Timings()
        timings = dataclasses.replace(timings, preprocess=timings.preprocess + read_s * 1e3)
        self.metrics.preprocess.labels(meta.modality, "read").observe(read_s)
        if part is not None and len(part.layouts) == len(rows):  # every item encoded here, in order: no copy
            embedding = part.embedding
        else:
            embedding = rows[0] if len(rows) == 1 else torch.cat(rows)
        return EncodedPart(embedding=embedding,
                           layouts=tuple(result.item.layout for result in resolved),
                           batch_size=part.batch_size if part else 0, timings=timings,
                           cached=tuple(tier is not None for tier in tiers), cache_tiers=tiers,
                           batch=part.batch if part else None)

    async def _encode_missing(self, meta: PartMeta, items: list[RawItem], waiting: SharedDemand,
                              layouts_known: LayoutsKnown | None) -> EncodedPart:
        """Decode the items the cache misses and encode them as one job (the cache cancels it when no
        request waits for it any more)."""
        started = time.perf_counter()

        async def decode(item: RawItem):
            try:
                return await self.media.decode_read(meta.modality, item, self.describe)
            except MediaError as exc:
                exc.item_digest, exc.item_location = item.digest, item.source.location
                raise

        results = await each_in_order([decode(item) for item in items])
        decoded = time.perf_counter()
        trace = CURRENT_TRACE.get()  # the traced request that started this computation, if any (ops.tracing)
        if trace is not None:
            trace.stage("decode", started, decoded, {"encoder.req_id": meta.req_id, "encoder.items": len(items)})
        return await self.submit(meta, results, decoded - started, waiting, layouts_known)


def _store_timeout(store: StoreTier, waiting: SharedDemand, now: float) -> float:
    """The Store's read deadline: `--cache-store-timeout-ms`, never past the most urgent waiting request's."""
    timeout = store.connection.config.read_timeout_s
    deadline = waiting.urgency.deadline
    return timeout if deadline is None else max(0.0, min(timeout, deadline - now))


def cache_capacity(settings: Settings) -> int:
    """`--cache-bytes` in bytes (auto: see `ops.memory.default_cache_bytes`; 0: off)."""
    return default_cache_bytes() if settings.cache_bytes == "auto" else int(settings.cache_bytes)


def item_keys(adapter: EncoderAdapter, limits: MediaLimits) -> ItemKeys:
    """The cache's keys: the model's fingerprint plus the decode settings that change an item's rows."""
    decode_settings = {"video": {"fps": limits.video_fps, "max_frames": limits.max_video_frames},
                       "audio": {"sample_rate": limits.audio_sample_rate}}
    return ItemKeys(adapter_fingerprint(adapter), decode_settings)


def _relocated(error: MediaError, read: list[RawItem]) -> str:
    """A decode error named with this request's item index (it may come from another request's computation)."""
    digest = getattr(error, "item_digest", None)
    for item in read:
        if digest is not None and item.digest == digest:
            return f"{item.source.location}{error.location[len(error.item_location):]}: {error.message}"
    return str(error)
