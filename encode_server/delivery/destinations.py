"""Where an embedding goes and in which frames: destinations, registrations, wire formats.

`Delivery` (the default `delivery.handover.Handover`) takes a finished request part and pushes it to
its destinations: the `tcp://host:port` endpoints the request named (`prefill_host` + `embedding_port`)
and the receivers registered for its `req_id` through `/scheduler_receive_url` (delivery waits until
`receive_count` distinct ones are in). An embedding that finished before anyone registered is parked for
late registrants. A request that names `prefill_host` without `embedding_port` (SGLang's
`zmq_to_scheduler` form) goes only to its registered receivers, and waits for them up to the send
timeout (then 502). When a request fails after admission, its destinations get an error message, so
prefill ranks never wait for it; a request waiting for registrations keeps that message for the
receivers that register after it failed.

What the frames hold is a `WireFormat`'s business (`NativeWire`: a JSON header and the raw bytes,
docs/CONTRACT.md section 3); moving frames is `delivery.sockets.EmbeddingSender`'s.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from encode_server.delivery.handover import Destinations, HandedOver, Handover
from encode_server.delivery.sockets import DeliveryError, EmbeddingSender
from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodedPart, EncodeError, PartMeta

log = logging.getLogger("encode_server.delivery.destinations")

Frames = list[bytes | memoryview]


class WireFormat(Protocol):
    """How one request part becomes a ZMQ message."""

    def success_frames(self, meta: PartMeta, part: EncodedPart) -> Frames:
        """The message carrying a part's embedding."""

    def failure_frames(self, meta: PartMeta, status: int, message: str) -> Frames:
        """The message telling receivers that a part failed."""


@dataclass
class _Registration:
    """Receivers that asked for one request's embedding, and its parts waiting for them."""

    count: int | None  # None until a receiver says how many to expect
    created: float
    urls: list[str] = field(default_factory=list)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    failure: Frames | None = None  # the failure message every later registrant gets at once
    expiry: asyncio.TimerHandle | None = None
    waiting: int = 0  # deliveries waiting for the receivers to complete


class ParkedParts:
    """Messages nobody registered for yet, by `req_id` and part, each kept `ttl_s` (at most `SWEEP_SLACK_S`
    longer) within a budget of bytes.

    Under a steady flow of requests that no receiver registers for (a client that reads the rows from the
    response), every answer parks one: so a park is a dict entry and a place in one queue, with one timer
    for all of them, not objects and a timer of its own (thousands of which would outlive the young
    generation and make the garbage collector's every pass longer). The TTL is the same for every part, so
    the queue is in order of expiry."""

    #: One sweep drops every part expired by then; the next is at least this much later.
    SWEEP_SLACK_S = 0.1

    def __init__(self, ttl_s: float, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.bytes = 0
        # Tuples of bytes and numbers only, which the collector stops tracking after their first pass.
        self._by_req: dict[str, dict[int, tuple[tuple[bytes, ...], int]]] = {}
        self._order: collections.deque[tuple[float, str, int, tuple[tuple[bytes, ...], int]]] = collections.deque()
        self._sweep: asyncio.TimerHandle | None = None

    def add(self, req_id: str, part_idx: int, frames: Frames) -> bool:
        """Keep a copy of `frames` (a view would keep the whole batch's rows alive); False when over budget."""
        nbytes = sum(len(frame) for frame in frames)
        if self.bytes + nbytes > self.max_bytes:
            return False
        kept = (tuple(bytes(frame) for frame in frames), nbytes)
        parts = self._by_req.get(req_id)
        if parts is None:
            parts = self._by_req[req_id] = {}
        replaced = parts.get(part_idx)
        if replaced is not None:
            self.bytes -= replaced[1]
        parts[part_idx] = kept
        self.bytes += nbytes
        loop = asyncio.get_running_loop()
        self._order.append((loop.time() + self.ttl_s, req_id, part_idx, kept))
        if self._sweep is None:
            self._sweep = loop.call_at(self._order[0][0], self._expire)
        return True

    def take(self, req_id: str) -> list[Frames]:
        """Every part kept for `req_id`, given up."""
        parts = self._by_req.pop(req_id, None)
        if not parts:
            return []
        self.bytes -= sum(nbytes for _, nbytes in parts.values())
        return [list(frames) for frames, _ in parts.values()]

    def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._order and self._order[0][0] <= now:
            _, req_id, part_idx, kept = self._order.popleft()
            parts = self._by_req.get(req_id)
            if parts is not None and parts.get(part_idx) is kept:  # not taken or replaced meanwhile
                del parts[part_idx]
                self.bytes -= kept[1]
                if not parts:
                    del self._by_req[req_id]
        self._sweep = (loop.call_at(max(self._order[0][0], now + self.SWEEP_SLACK_S), self._expire)
                       if self._order else None)

    def req_ids(self) -> set[str]:
        return set(self._by_req)

    def __len__(self) -> int:
        """How many parts are kept."""
        return sum(len(parts) for parts in self._by_req.values())

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None


class Registrations:
    """`/scheduler_receive_url` state: who wants which `req_id`, and embeddings waiting for them."""

    def __init__(self, sender: EmbeddingSender, ttl_s: float, park_ttl_s: float | None = None,
                 max_parked_bytes: int = 256 << 20) -> None:
        self.sender = sender
        self.ttl_s = ttl_s  # how long a registration is remembered
        self._parked = ParkedParts(ttl_s if park_ttl_s is None else park_ttl_s, max_parked_bytes)
        self._by_req: dict[str, _Registration] = {}
        self._tasks: set[asyncio.Task] = set()

    def _entry(self, req_id: str, count: int | None) -> _Registration:
        entry = self._by_req.get(req_id)
        if entry is None:
            entry = self._by_req[req_id] = _Registration(count=count, created=time.monotonic())
            entry.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._expire, req_id, entry)
        return entry

    def _expire(self, req_id: str, entry: _Registration) -> None:
        if self._by_req.get(req_id) is entry:
            del self._by_req[req_id]

    def register(self, req_id: str, url: str, count: int) -> int:
        """Add a receiver; returns how many distinct ones are registered. ValueError on a count clash."""
        entry = self._entry(req_id, count)
        if entry.count is None:
            entry.count = count
        if entry.count != count:
            raise ValueError(f"receive_count {count} differs from the {entry.count} registered before for {req_id!r}")
        if url not in entry.urls:
            entry.urls.append(url)
            if entry.failure is not None:
                self._background(self._deliver_failure(req_id, url, entry.failure))
        if len(entry.urls) >= entry.count and not entry.complete.is_set():
            entry.complete.set()
            for frames in self._parked.take(req_id):
                self._background(self._deliver_parked(req_id, entry, frames))
        return len(entry.urls)

    def _background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver_failure(self, req_id: str, url: str, frames: Frames) -> None:
        try:
            await self.sender.send([url], frames)
        except DeliveryError as exc:
            log.warning("could not tell a late receiver that %s failed: %s", req_id, exc)

    def park_failure(self, req_id: str, frames: Frames) -> None:
        """Keep a failure message for receivers that register after the request failed (until the TTL)."""
        self._entry(req_id, count=None).failure = frames

    async def _deliver_parked(self, req_id: str, entry: _Registration, frames: Frames) -> None:
        try:
            await self.sender.send(list(entry.urls), frames)
        except DeliveryError as exc:
            log.warning("late delivery of %s failed: %s", req_id, exc)

    def wanted(self, req_id: str) -> bool:
        """Whether a receiver has registered for `req_id` (parked embeddings alone do not count)."""
        entry = self._by_req.get(req_id)
        return entry is not None and bool(entry.urls)

    def known_receivers(self, req_id: str) -> list[str]:
        entry = self._by_req.get(req_id)
        return list(entry.urls) if entry else []

    async def receivers(self, req_id: str, timeout: float) -> list[str]:
        """The registered receivers once `receive_count` are in; TimeoutError after `timeout`."""
        entry = self._entry(req_id, count=None)
        entry.waiting += 1
        try:
            await asyncio.wait_for(entry.complete.wait(), timeout)
        finally:
            entry.waiting -= 1
        return list(entry.urls)

    def park(self, req_id: str, part_idx: int, frames: Frames) -> None:
        """Keep a message nobody registered for yet, until registrations complete or the park TTL passes."""
        if not self._parked.add(req_id, part_idx, frames):
            log.warning("not keeping %s for late registration: %d bytes already parked", req_id, self._parked.bytes)

    def __len__(self) -> int:
        """How many `req_id`s are remembered (registered, waited for, parked or failed)."""
        return len(self._by_req.keys() | self._parked.req_ids())

    def parked(self) -> tuple[int, int]:
        """(bytes, embeddings) parked now, for the metrics."""
        return self._parked.bytes, len(self._parked)

    async def close(self) -> None:
        self._parked.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Delivery(Handover):
    """The ZMQ hand-over: pushes finished parts to their destinations, and failure notices when a part fails."""

    def __init__(self, sender: EmbeddingSender, wire: WireFormat, metrics: ServerMetrics, send_timeout_s: float,
                 registration_ttl_s: float) -> None:
        self.sender = sender
        self.wire = wire
        self.metrics = metrics
        self.send_timeout_s = send_timeout_s
        self._registration_ttl_s = registration_ttl_s
        self.registrations: Registrations | None = None  # made in start(): it needs the running loop
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        # An unclaimed embedding is kept only as long as a receiver may take to register (--send-timeout-s).
        self.registrations = Registrations(self.sender, ttl_s=self._registration_ttl_s,
                                           park_ttl_s=self.send_timeout_s)
        self.metrics.watch_parked(self.registrations.parked)

    async def close(self) -> None:
        if self.registrations is not None:
            await self.registrations.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self.sender.close()

    def register(self, req_id: str, url: str, count: int) -> int:
        """`/scheduler_receive_url`: add a receiver for `req_id` (ValueError on a count clash)."""
        return self.registrations.register(req_id, url, count)

    async def deliver(self, meta: PartMeta, endpoints: Sequence[str], part: EncodedPart,
                      returned_inline: bool, await_registrations: bool = False) -> float:
        """Push the part to every destination; seconds spent. 502 when one does not take it.

        `await_registrations`: the request's receivers register (SGLang's `prefill_host` with a null
        `embedding_port`); wait for them. With no destination, the part is parked for late registrants
        unless the caller gets it inline."""
        started = time.perf_counter()
        destinations = list(endpoints)
        if await_registrations or self.registrations.wanted(meta.req_id):
            try:
                destinations += await self.registrations.receivers(meta.req_id, self.send_timeout_s)
            except asyncio.TimeoutError:
                known = len(self.registrations.known_receivers(meta.req_id))
                error = EncodeError(502, f"the receivers registered for {meta.req_id!r} did not reach their "
                                         f"receive_count within {self.send_timeout_s:g} s ({known} registered; "
                                         "--send-timeout-s)",
                                    meta.req_id)
                self.notify_failure(meta, endpoints, error, await_registrations=True)
                raise error from None
        frames = self.wire.success_frames(meta, part)
        if not destinations:
            if not returned_inline:
                self.registrations.park(meta.req_id, meta.part_idx, frames)
            return 0.0
        try:
            sent = await self.sender.send(list(dict.fromkeys(destinations)), frames)
        except DeliveryError as exc:
            raise EncodeError(502, f"could not deliver the embedding: {exc}", meta.req_id) from None
        elapsed = time.perf_counter() - started
        self.metrics.transfer.labels(meta.modality).observe(elapsed)
        self.metrics.bytes_sent.inc(sent)
        return elapsed

    async def hand_over(self, to: Destinations, part: EncodedPart) -> HandedOver:
        """`deliver` the part to the request's destinations."""
        return HandedOver(await self.deliver(to.meta, to.endpoints, part, to.inline, to.registered))

    def failed(self, to: Destinations, error: EncodeError) -> None:
        if error.status != 502:  # 502: they could not be reached (and `deliver` told those it could)
            self.notify_failure(to.meta, to.endpoints, error, to.registered)

    def notify_failure(self, meta: PartMeta, endpoints: Sequence[str], error: EncodeError,
                       await_registrations: bool = False) -> None:
        """Tell the part's destinations, in the background, that it failed (and, when its receivers
        register, those that register later)."""
        destinations = list(endpoints)
        if self.registrations.wanted(meta.req_id):
            destinations += self.registrations.known_receivers(meta.req_id)
        frames = self.wire.failure_frames(meta, error.status, error.message)
        if await_registrations:
            self.registrations.park_failure(meta.req_id, frames)
        if not destinations:
            return
        task = asyncio.get_running_loop().create_task(self._send_failure(list(dict.fromkeys(destinations)), meta,
                                                                          frames))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_failure(self, destinations: list[str], meta: PartMeta, frames: Frames) -> None:
        try:
            await self.sender.send(destinations, frames)
        except DeliveryError as exc:
            log.warning("could not tell %s's destinations that it failed: %s", meta.req_id, exc)
