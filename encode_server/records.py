"""The typed records that flow one way through the service.

Each stage builds its record once and never changes it (a later stage that adds something makes a
new record with `dataclasses.replace`):

- `EncodeJob`: an admitted request part, with its items decoded and their expected layouts
  (built by the service, read by the scheduler, the engine and the parallel ranks);
- `Timings`: where a request's time went, in milliseconds;
- `EncodedPart`: what the engine hands back for one job (its rows and layouts, the batch size, the
  preprocess and encode timings); the scheduler returns a copy with the queue time filled in;
- `BatchInfo`: the forward a traced job joined (its id, size, stage times), for the request's spans;
- `EncodeError`: any failure, carrying the HTTP status it maps to;
- `LayoutsKnown`: the one callback that travels with a part, told its items' layouts before the forward
  (a hand-over whose receivers size their buffers ahead: `delivery.handover`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from encode_server.models import ItemLayout

#: Called once with every item's layout of a part as soon as they are known (before the forward).
LayoutsKnown = Callable[[Sequence[ItemLayout]], None]


class EncodeError(Exception):
    """A request that ends in an error response: status code, message, and optional headers."""

    def __init__(self, status: int, message: str, req_id: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.req_id = req_id
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.req_id)


def error_body(message: str, req_id: str | None = None) -> dict[str, Any]:
    """The JSON body of every error response (docs/CONTRACT.md, section 2)."""
    return {"status": "error", "message": message, "req_id": req_id}


@dataclass(frozen=True)
class PartMeta:
    """Which request part a message is about: what every wire format and response names."""

    req_id: str
    part_idx: int
    num_parts: int
    modality: str


@dataclass(frozen=True)
class EncodeJob:
    """One request part, validated, with decoded items and their expected layouts."""

    meta: PartMeta
    items: tuple[Any, ...]  # decoded media (PIL images, frame lists, waveforms)
    layouts: tuple[ItemLayout, ...]
    raw_items: tuple[Any, ...] = ()  # each item's file bytes (or frames' bytes), for tensor-parallel ranks
    decode_s: float = 0.0  # time spent fetching and decoding the items
    probe: bool = False  # a health probe: runs alone as soon as there is room, never waits for company
    trace: Any = None  # the request's `ops.tracing.RequestTrace` when it is traced, else None

    @property
    def req_id(self) -> str:
        return self.meta.req_id

    @property
    def modality(self) -> str:
        return self.meta.modality

    @property
    def tokens(self) -> int:
        return sum(layout.tokens for layout in self.layouts)


@dataclass(frozen=True)
class Timings:
    """Where one request's time went, in milliseconds."""

    queue: float = 0.0
    preprocess: float = 0.0
    encode: float = 0.0
    transfer: float = 0.0
    # The batch's CPU time in the processor's thread and in the forward's (not in the response: what the
    # scheduler's overlap choice learns from); 0.0 where the engine did not measure it (a pool, a replica).
    prepare_cpu: float = 0.0
    forward_cpu: float = 0.0

    def with_queue(self, queue_ms: float) -> Timings:
        return Timings(queue_ms, self.preprocess, self.encode, self.transfer, self.prepare_cpu, self.forward_cpu)

    def with_transfer(self, transfer_ms: float) -> Timings:
        return Timings(self.queue, self.preprocess, self.encode, transfer_ms, self.prepare_cpu, self.forward_cpu)

    def as_json(self) -> dict[str, float]:
        return {"queue": self.queue, "preprocess": self.preprocess, "encode": self.encode,
                "transfer": self.transfer}


@dataclass(frozen=True)
class BatchInfo:
    """The forward a traced job joined: built by the engine only for a batch that holds a traced job. Times are
    `time.perf_counter()` seconds; `span` is the batch span's context (`ops.tracing`), which the request's
    forward span links to."""

    batch_id: int
    modality: str
    size: int  # jobs (requests) in the batch
    items: int
    tokens: int  # the batch's rows
    where: str  # which replica, and whether the preprocessing pool prepared it
    dispatched: float  # when the scheduler handed the batch to the engine: the end of its jobs' queue wait
    preprocess: tuple[float, float]  # (start, end) of the processor (or the pool's preparation)
    forward: tuple[float, float]  # (start, end) of the forward
    span: Any = None


@dataclass(frozen=True)
class EncodedPart:
    """A finished job: its embedding rows `[tokens, row width]` on the CPU, layouts, batch size, timings."""

    embedding: torch.Tensor
    layouts: tuple[ItemLayout, ...]
    batch_size: int
    timings: Timings = Timings()
    cached: tuple[bool, ...] = ()  # per item: served by the embedding cache (empty: the cache was not asked)
    # per item: which tier served it ("local": this server's cache, "store": the shared Mooncake Store tier),
    # None where it was encoded; empty when the cache was not asked
    cache_tiers: tuple[str | None, ...] = ()
    batch: BatchInfo | None = None  # the forward it came from, for a traced request (None otherwise)

    def with_timings(self, timings: Timings) -> EncodedPart:
        """This part with `timings`: `dataclasses.replace` without its per-call look at the fields (it runs for
        every request)."""
        return EncodedPart(self.embedding, self.layouts, self.batch_size, timings, self.cached, self.cache_tiers,
                           self.batch)

    def items_json(self) -> list[dict[str, Any]]:
        """The response's and the wire header's `items`: each layout, `cached` when the cache was asked, and
        `cache_tier` ("local" or "store") on the items it served."""
        items = [layout.as_json() for layout in self.layouts]
        for item, cached in zip(items, self.cached):
            item["cached"] = cached
        for item, tier in zip(items, self.cache_tiers):
            if tier is not None:
                item["cache_tier"] = tier
        return items
