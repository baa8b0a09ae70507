"""The encode path from a parsed body to a response, independent of the HTTP framework; it runs requests and
builds nothing (`assembly.build_service` builds its parts).

`EncoderService` runs each request through its parts, one way: admission (validate, admit, deadline) ->
`PartEncoder` (fetch and decode each item, or take it from the embedding cache) -> `JobQueue`, the scheduler
and the engine (one fused forward) -> the hand-over (`delivery.handover`: ZMQ destinations and
registrations, or staged for receivers that pull) -> response. It also owns what concerns the whole
server: the health probe's verdict (a tiny request through the same path), server info, draining and the
death of a parallel rank.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch
from pydantic import ValidationError

import encode_server
from encode_server.admission.gate import Admission
from encode_server.admission.schemas import EncodeRequest, ReceiveUrlRequest, describe_validation_error, request_id_of
from encode_server.cache.cached_encoding import CachedEncoding
from encode_server.cache.embedding_cache import CachedItem, EmbeddingCache
from encode_server.cache.store_client import StoreConnection
from encode_server.cache.store_tier import row_widths
from encode_server.delivery.destinations import Delivery
from encode_server.delivery.handover import Destinations, Handover
from encode_server.delivery.sockets import check_endpoint
from encode_server.engine import EncoderEngine
from encode_server.media.decoding import MediaError
from encode_server.media.loader import LoadedItem, MediaLoader, parse_item
from encode_server.media.priority_pool import CURRENT_PRIORITY, PriorityThreadPool
from encode_server.models import EncoderAdapter
from encode_server.models.dtypes import DTYPE_NAMES
from encode_server.ops.health import HealthProbe
from encode_server.ops.metrics import LoopLagMonitor, ServerMetrics
from encode_server.ops.settings import Settings
from encode_server.ops.tracing import CURRENT as CURRENT_TRACE
from encode_server.parallel.ranks import WorkerGroup, WorkerRank
from encode_server.records import EncodedPart, EncodeError, EncodeJob, LayoutsKnown, PartMeta
from encode_server.responses import encode_response
from encode_server.scheduling.clock import Clock
from encode_server.scheduling.cost_model import CostModel
from encode_server.scheduling.demand import Demand, SharedDemand
from encode_server.scheduling.load import LoadReport, ModalityLoad
from encode_server.scheduling.scheduler import EncoderScheduler
from encode_server.scheduling.scheduler_thread import SchedulerThread

if TYPE_CHECKING:  # the pool's module starts nothing when imported, but only a server with workers needs it
    from encode_server.preprocessing.pool import PreprocessPool

log = logging.getLogger("encode_server.service")

T = TypeVar("T")

#: The `req_id` of health probes.
PROBE_REQ_ID = "__health_probe__"


def awaits_registrations(request: EncodeRequest) -> bool:
    """SGLang's `zmq_to_scheduler` form: `prefill_host` without ports means its ranks will register."""
    return request.prefill_host is not None and request.embedding_port is None


class JobQueue:
    """A part's decoded items as one `EncodeJob` on the scheduler's queue, and its rows back."""

    def __init__(self, scheduler: EncoderScheduler | SchedulerThread, metrics: ServerMetrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics

    async def submit(self, meta: PartMeta, loaded: Sequence[LoadedItem], decode_s: float, deadline: float,
                     priority: int = 0, probe: bool = False, layouts_known: LayoutsKnown | None = None) -> EncodedPart:
        """Queue the items as one job and await its rows."""
        return await self.scheduler.submit(self._job(meta, loaded, decode_s, probe, layouts_known), deadline, priority)

    async def submit_shared(self, meta: PartMeta, loaded: Sequence[LoadedItem], decode_s: float,
                            waiting: SharedDemand, layouts_known: LayoutsKnown | None = None) -> EncodedPart:
        """Queue the embedding cache's misses as one job that belongs to the requests `waiting` for it: placed
        by the most urgent of them, dropped only after the last one's deadline, and moved as they come and go."""
        urgency = waiting.urgency
        future = self.scheduler.submit(self._job(meta, loaded, decode_s, layouts_known=layouts_known),
                                       urgency.deadline, urgency.priority, urgency.expires)
        waiting.watch(lambda now: self.scheduler.reprioritize(future, now.deadline, now.priority, now.expires))
        try:
            return await future
        finally:
            waiting.watch(None)

    def _job(self, meta: PartMeta, loaded: Sequence[LoadedItem], decode_s: float, probe: bool = False,
             layouts_known: LayoutsKnown | None = None) -> EncodeJob:
        self.metrics.preprocess.labels(meta.modality, "decode").observe(decode_s)
        if layouts_known is not None:  # before the forward: receivers that pull size their buffers meanwhile
            layouts_known([item.layout for item in loaded])
        return EncodeJob(meta=meta, items=tuple(item.decoded for item in loaded),
                         layouts=tuple(item.layout for item in loaded), raw_items=tuple(item.raw for item in loaded),
                         decode_s=decode_s, probe=probe, trace=None if probe else CURRENT_TRACE.get())


class PartEncoder:
    """A part's raw items to its rows: each parsed, fetched and decoded on its own (with the embedding cache
    on, only those it does not hold), then encoded in one fused job."""

    def __init__(self, adapter: EncoderAdapter, media: MediaLoader, jobs: JobQueue, cached: CachedEncoding | None,
                 clock: Clock, probe_input: tuple[str, bytes] | None = None) -> None:
        self.adapter = adapter
        # The health probe's (modality, file bytes): the model's sample fitted to the decode limits
        # (`assembly.probe_sample`); the sample as it is by default.
        self.probe_input = probe_input
        self.media = media
        self.jobs = jobs
        self.cached = cached
        self.clock = clock

    async def encode(self, meta: PartMeta, raw_items: Sequence[object], deadline: float, priority: int = 0,
                     layouts_known: LayoutsKnown | None = None, probe: bool = False) -> EncodedPart:
        """The part's rows (health probes always go to the encoder); `layouts_known` hears the items'
        layouts before the forward when one job holds all of them. A bad item is a 400."""
        decode_started = time.perf_counter()
        CURRENT_PRIORITY.set(priority)  # this request's task only: its decodes queue by priority
        trace = CURRENT_TRACE.get()  # None unless this request is traced (ops.tracing)
        try:
            sources = [parse_item(raw, index, meta.modality) for index, raw in enumerate(raw_items)]
            if self.cached is not None and not probe:
                part = await self.cached.encode(meta, sources, decode_started, Demand(deadline, priority),
                                                layouts_known)
                if trace is not None:
                    trace.encoded(part, decode_started, meta.req_id)
                return part
            loaded = await self.media.load(meta.modality, sources, self.adapter.processor.item_layout)
        except MediaError as exc:
            raise EncodeError(400, str(exc), meta.req_id) from None
        decoded = time.perf_counter()
        if trace is not None:
            trace.stage("decode", decode_started, decoded, {"encoder.req_id": meta.req_id,
                                                            "encoder.items": len(loaded)})
        part = await self.jobs.submit(meta, loaded, decoded - decode_started, deadline, priority, probe,
                                      layouts_known)
        if trace is not None:
            trace.encoded(part, decoded, meta.req_id)
        return part

    async def encode_identified(self, meta: PartMeta, keys: Sequence[Hashable], items: Sequence[LoadedItem],
                                deadline: float, priority: int = 0) -> tuple[EncodedPart, list[CachedItem]]:
        """Items decoded and identified by a front (`keys`: its identities of them): with the embedding cache on,
        what it holds is taken and what other requests are encoding joined, under `keys`; the rest encoded as one
        job. The part (for the request's records) and each item's rows and layout, in order."""
        CURRENT_PRIORITY.set(priority)
        trace = CURRENT_TRACE.get()  # None unless this request is traced (ops.tracing)
        started = time.perf_counter()
        if self.cached is None:
            part = await self.jobs.submit(meta, items, 0.0, deadline, priority)
            if trace is not None:
                trace.encoded(part, started, meta.req_id)
            pieces = torch.split(part.embedding, [layout.tokens for layout in part.layouts])
            return part, [CachedItem(piece, layout) for piece, layout in zip(pieces, part.layouts)]
        own: list[EncodedPart] = []

        async def compute(positions: list[int], waiting: SharedDemand) -> list[CachedItem]:
            part = await self.jobs.submit_shared(meta, [items[position] for position in positions], 0.0, waiting)
            own.append(part)
            pieces = torch.split(part.embedding, [layout.tokens for layout in part.layouts])
            return [CachedItem.compact(piece, layout) for piece, layout in zip(pieces, part.layouts)]

        try:
            resolved = await self.cached.cache.resolve(list(keys), compute, Demand(deadline, priority))
        except EncodeError as exc:  # maybe another request's computation: this request's id
            raise EncodeError(exc.status, exc.message, meta.req_id, exc.headers) from None
        part = own[0] if own else EncodedPart(torch.empty(0), (), 0)
        part = EncodedPart(part.embedding, tuple(result.item.layout for result in resolved), part.batch_size,
                           part.timings, tuple(result.cached for result in resolved),
                           tuple("local" if result.cached else None for result in resolved), part.batch)
        if trace is not None:
            trace.encoded(part, started, meta.req_id)
        return part, [result.item for result in resolved]

    async def probe(self, timeout_s: float) -> None:
        """A tiny built-in input through decode, scheduler, processor, forward and slicing (the health probe)."""
        modality, data = self.probe_input or self.adapter.processor.sample_encoded()
        meta = PartMeta(req_id=PROBE_REQ_ID, part_idx=0, num_parts=1, modality=modality)
        part = await self.encode(meta, [base64.b64encode(data).decode("ascii")], self.clock.now() + timeout_s,
                                 probe=True)
        tokens = sum(layout.tokens for layout in part.layouts)
        if part.embedding.shape[0] != tokens:
            raise RuntimeError(f"probe embedding has shape {tuple(part.embedding.shape)} for {tokens} tokens")
        if not torch.isfinite(part.embedding).all():
            raise RuntimeError("probe embedding holds NaN or infinite values")


@dataclass(frozen=True)
class ServiceParts:
    """What `EncoderService` runs requests through, built by `assembly.build_service`."""

    adapter: EncoderAdapter
    group: WorkerGroup | None  # the other parallel ranks, or None with one
    clock: Clock
    metrics: ServerMetrics
    admission: Admission
    media_pool: PriorityThreadPool  # decoding threads, by priority
    media: MediaLoader
    preprocess_pool: PreprocessPool | None  # `--preprocess-workers` processes, or None: preprocessing in-process
    cache: EmbeddingCache
    store: StoreConnection | None  # the shared second tier (`--cache-store`), or None
    cached: CachedEncoding | None  # the request path through the cache, None with it off
    engine: EncoderEngine
    costs: CostModel
    scheduler: EncoderScheduler | SchedulerThread
    encoder: PartEncoder
    delivery: Delivery  # ZMQ delivery and `/scheduler_receive_url`'s registrations
    handover: Handover  # how rows leave: `delivery`, or a front's (chosen once, when the runtime is built)
    health: HealthProbe
    loop_lag: Mapping[str, LoopLagMonitor]  # "http" and "scheduler"


class EncoderService:
    """Everything one server process needs to answer `/encode`, given its built parts (`ServiceParts`).

    With a `SchedulerThread` (as the server runs it) the engine and the scheduler run on an event loop of their
    own, so HTTP work never delays a batch; with an `EncoderScheduler`, on this loop (the in-process tests,
    whose fake clock steps one loop)."""

    def __init__(self, settings: Settings, parts: ServiceParts) -> None:
        self.settings = settings
        self.parts = parts
        self.adapter = parts.adapter
        self.group = parts.group
        self.clock = parts.clock
        self.metrics = parts.metrics
        self.admission = parts.admission
        self.preprocess_pool = parts.preprocess_pool
        self.media = parts.media
        self.cache = parts.cache
        self.store = parts.store
        self.cached = parts.cached
        self.engine = parts.engine
        self.costs = parts.costs
        self.scheduler = parts.scheduler
        self.encoder = parts.encoder
        self.delivery = parts.delivery
        self.handover = parts.handover
        self.health = parts.health
        self.health.on_finish = self.healthy  # each probe's verdict reaches encoder_healthy at once
        self.started_at = time.time()
        # Called once when draining begins (`on_drain`): fronts that announced this server withdraw it.
        self._drain_listeners: list[Callable[[], None]] = []
        self._drain_told = False

    @property
    def media_pool(self) -> PriorityThreadPool:
        """The threads that decode media (by priority), for producers that decode items themselves."""
        return self.parts.media_pool

    @property
    def decodes_elsewhere(self) -> bool:
        """Whether items are decoded again outside this process (the preprocessing pool's workers, the other
        ranks), which then need each item's file bytes (`LoadedItem.raw`)."""
        return self.preprocess_pool is not None or self.group is not None

    @property
    def pending(self) -> int:
        return self.admission.pending

    async def start(self) -> None:
        if self.store is not None:  # refuses the start against a Store of a protocol it cannot read
            await asyncio.to_thread(self.store.start)
        await asyncio.to_thread(self.media.warmup, self.adapter.info.modalities)
        if self.preprocess_pool is not None:  # seconds: each worker is a process that imports the processor
            log.info("starting %d preprocessing worker processes", self.preprocess_pool.size)
            began = time.monotonic()
            await asyncio.to_thread(self.preprocess_pool.start)
            log.info("preprocessing workers ready in %.1f s", time.monotonic() - began)
        self.delivery.start()
        if self.group is not None:
            loop = asyncio.get_running_loop()
            self.group.on_death(lambda worker: loop.call_soon_threadsafe(self._rank_died, worker))
        self.scheduler.start()
        self.metrics.healthy.set(1)  # warm-up ran a forward; every verdict from here on sets it (`healthy`)
        self.parts.loop_lag["http"].start()
        self.scheduler.call(self.parts.loop_lag["scheduler"].start).result()  # on its loop (this one, without a thread)
        self.health.verdict()  # the first probe starts now, in the background

    async def stop(self) -> None:
        self.parts.loop_lag["http"].stop()
        await self.scheduler.run(self.parts.loop_lag["scheduler"].stop)
        await self.health.close()
        await self.scheduler.stop()
        await self.delivery.close()
        await self.media.close()
        if self.group is not None:
            await asyncio.to_thread(self.group.stop)
        self.engine.close()
        if self.preprocess_pool is not None:
            await asyncio.to_thread(self.preprocess_pool.close)
        self.parts.media_pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # --- one request -----------------------------------------------------------------------------

    async def encode(self, payload: object, front: str = "http") -> dict[str, object]:
        """Answer one `/encode` body (already JSON-decoded), which came in by `front` (`ops.metrics.FRONTS`).
        Raises `EncodeError` for any failure."""
        request, meta, endpoints = self.admission.validate(payload)
        to = Destinations(meta, tuple(endpoints), inline=request.return_embedding,
                          registered=awaits_registrations(request))
        return await self._admitted(request, lambda deadline: self._serve(request, to, deadline),
                                    lambda error: self.handover.failed(to, error),
                                    " (the request's timeout_s, at most --req-timeout-s)", front)

    async def encode_identified(self, req_id: str, modality: str, keys: Sequence[Hashable], items: Sequence[LoadedItem],
                                priority: int = 0) -> list[CachedItem]:
        """Encode items a front decoded and identified itself (`items`: decoded, with their layouts; `keys`: the
        front's identities of them) through admission, the scheduler and the engine like any `/encode` request
        (batched with them), never hashed or decoded again: the embedding cache finds and keeps them under `keys`,
        and one encoding serves every request naming the same key. Each item's rows and layout, in order;
        `EncodeError` on failure. The entry point of producers that hand rows over themselves (the vLLM front)."""
        request = EncodeRequest(req_id=req_id, modality=modality, mm_items=list(items), priority=priority)
        meta = PartMeta(req_id=req_id, part_idx=0, num_parts=1, modality=modality)
        return await self._admitted(request, lambda deadline: self.encoder.encode_identified(
            meta, keys, items, deadline, priority), front="vllm")

    async def _admitted(self, request: EncodeRequest, work: Callable[[float], Awaitable[tuple[EncodedPart, T]]],
                        on_failure: Callable[[EncodeError], None] | None = None, timeout_hint: str = "",
                        front: str = "http") -> T:
        """Run `work(deadline)` for an admitted request within its timeout, and return its answer. Its ticket
        records how it ended; a timeout is a 504, a 500 while a rank is down a 503; `on_failure` is told of
        every failure but a cancellation (the client went away)."""
        with self.admission.admit(request, front) as ticket:
            trace = CURRENT_TRACE.get()  # None unless this request is traced (ops.tracing)
            if trace is not None:
                trace.admitted(request.req_id, request.modality, len(request.mm_items), request.priority)
            try:
                part, answer = await asyncio.wait_for(work(ticket.deadline), ticket.timeout_s)
            except asyncio.TimeoutError:
                error = EncodeError(504, f"request timed out after {ticket.timeout_s:g} s{timeout_hint}",
                                    request.req_id)
            except EncodeError as exc:
                error = exc
                if error.status == 500 and self.admission.broken:
                    error = EncodeError(503, self.admission.broken, request.req_id, headers={"Retry-After": "5"})
            except asyncio.CancelledError:
                ticket.status = "cancelled"
                raise
            else:
                ticket.status = "200"
                self.metrics.performance.record(self.clock.now() - ticket.started, part.batch_size,
                                                len(part.layouts), sum(part.cached))
                return answer
            ticket.status = str(error.status)
            if on_failure is not None:
                on_failure(error)
            raise error from None

    async def _serve(self, request: EncodeRequest, to: Destinations,
                     deadline: float) -> tuple[EncodedPart, dict[str, object]]:
        """Encode an admitted request, hand it over, and build its response."""
        part = await self.encoder.encode(to.meta, request.mm_items, deadline, request.priority,
                                         self.handover.layouts_known(to))
        trace = CURRENT_TRACE.get()  # None unless this request is traced (ops.tracing)
        handing = time.perf_counter() if trace is not None else 0.0
        handed = await self.handover.hand_over(to, part)
        if trace is not None:
            trace.delivered(handing, len(to.endpoints), handed.transfer_s * 1e3)
        if handed.transfer_s:  # 0.0: nothing was sent (staged, parked for later receivers, or returned inline)
            part = part.with_timings(part.timings.with_transfer(handed.transfer_s * 1e3))
        response = await encode_response(to.meta, part, request.return_embedding, self.metrics,
                                         self.adapter.info.deepstack_of(to.meta.modality))
        return part, {**response, **handed.fields}

    async def register_receiver(self, payload: object) -> dict[str, object]:
        """`/scheduler_receive_url`: a prefill rank asks for a request's embedding."""
        if not isinstance(payload, dict):
            raise EncodeError(400, f"the body must be a JSON object, got {type(payload).__name__}")
        try:
            registration = ReceiveUrlRequest.model_validate(payload)
            url = check_endpoint(registration.receive_url)
            count = self.delivery.register(registration.req_id, url, registration.receive_count)
        except ValidationError as exc:
            raise EncodeError(400, describe_validation_error(exc), request_id_of(payload)) from None
        except ValueError as exc:
            raise EncodeError(400, f"receive_url: {exc}" if "receive_count" not in str(exc) else str(exc),
                              request_id_of(payload)) from None
        return {"status": "ok", "req_id": registration.req_id, "registered": count,
                "receive_count": registration.receive_count}

    # --- the whole server ------------------------------------------------------------------------

    def _rank_died(self, worker: WorkerRank) -> None:
        if self.engine.replicas is not None:
            # Its batches are retried on the others; the replicas live on the scheduler's loop.
            self.scheduler.call(self.engine.replicas.replica_died, worker.rank)
            return
        self.admission.broken = (f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited; "
                                 f"this server cannot encode until it is restarted")
        self.healthy()
        self.scheduler.fail_queued(self.admission.broken)

    def healthy(self) -> tuple[bool, str]:
        """Whether `/health` should say ok, and why not."""
        if self.admission.broken:
            verdict = (False, self.admission.broken)
        elif self.admission.draining:
            verdict = (False, "draining: the server is shutting down")
        elif not self.scheduler.running:
            verdict = (False, "the scheduler is not running")
        elif self.preprocess_pool is not None and self.preprocess_pool.broken:
            verdict = (False, self.preprocess_pool.broken)
        else:
            verdict = self.health.verdict()
        self.metrics.healthy.set(1 if verdict[0] else 0)
        return verdict

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on this loop) as soon as draining begins, e.g. to withdraw from a registry."""
        self._drain_listeners.append(listener)

    def begin_drain(self) -> None:
        """Stop admitting: new requests and /health get 503; those in flight go on. The drain listeners are
        told at once (a registry then stops dispatching here)."""
        self.admission.begin_drain()
        self.healthy()
        if not self._drain_told:
            self._drain_told = True
            for listener in self._drain_listeners:
                listener()

    async def wait_drained(self, timeout: float) -> bool:
        """True when every admitted request has left within `timeout` seconds."""
        return await self.admission.wait_drained(timeout)

    def fail_queued(self, message: str) -> None:
        """Fail every request still waiting for a batch (503), e.g. when a drain times out."""
        self.scheduler.fail_queued(message)

    def give_up(self, message: str) -> None:
        """A second signal: stop admitting, fail what is queued with 503, and let what fails from here on
        (batches cut short as the server stops) answer 503 `message` too, never 500."""
        self.begin_drain()
        self.admission.broken = self.admission.broken or message
        self.fail_queued(message)

    def server_info(self) -> dict[str, object]:
        info = self.adapter.info
        return {
            "version": encode_server.__version__,
            "settings": self.settings.public_dict(),
            "model": {"name": info.name, "family": info.family, "modalities": list(info.modalities),
                      "hidden_size": info.hidden_size, "deepstack": info.deepstack, "row_width": info.row_width,
                      "row_widths": row_widths(info),
                      **({"placeholder_tokens": info.placeholder_tokens} if info.placeholder_tokens else {}),
                      "device": str(self.adapter.device),
                      "dtype": DTYPE_NAMES[self.adapter.dtype]},
            "ranks": self.group.ranks() if self.group else [{"rank": 0, "pid": os.getpid(), "role": "tp",
                                                             "alive": True}],
            "pending": self.pending,
            "queue_depth": self.scheduler.queue_depth,
            "batches_in_flight_max": self.scheduler.max_in_flight,
            "overlap": self.scheduler.overlap_info(),
            "uptime_s": time.time() - self.started_at,
            "cache_store": self.store_info(),
            # front -> status -> finished requests: which doors the requests came in by (ops.metrics.FRONTS)
            "fronts": self.metrics.answered_by_front(),
        }

    def store_info(self) -> dict[str, object] | None:
        """The shared tier (--cache-store): where, its state, namespace, counters; None when off."""
        if self.store is None:
            return None
        stats = self.store.stats
        pending_items, pending_bytes = self.store.pending
        return {"master": self.store.config.master_server_address, "state": self.store.state,
                "refusal": self.store.refusal, "protocol": self.store.config.protocol,
                "metadata_server": self.store.config.metadata_server,
                "namespace": str(self.cached.store.namespace) if self.cached and self.cached.store else None,
                "hits": stats.hits, "misses": stats.misses, "corrupt": stats.corrupt,
                "read_timeouts": stats.read_timeouts, "read_errors": stats.read_errors,
                "reads_skipped": stats.reads_skipped, "published": stats.published,
                "publish_drops": stats.publish_drops, "publish_errors": stats.publish_errors,
                "pending_items": pending_items, "pending_bytes": pending_bytes, "reconnects": stats.reconnects}

    async def load_report(self) -> LoadReport:
        """`GET /v1/load`: the queue per modality (every modality of the model), the batches in flight and a
        newcomer's estimated wait, taken on the scheduler's loop; the last minute's signals; pending; draining."""
        self.metrics.load = queue = await self._queue_load()
        return LoadReport(self.admission.draining, self.pending, queue, self.metrics.signals())

    async def _queue_load(self):
        owner = getattr(self.scheduler, "scheduler", self.scheduler)  # the EncoderScheduler, run on its own loop
        queue = await self.scheduler.run(owner.load, max(1, self.settings.dp_size))
        idle = {modality: ModalityLoad() for modality in self.adapter.info.modalities}
        return replace(queue, modalities={**idle, **queue.modalities})

    async def metrics_text(self) -> bytes:
        """`/metrics`: the health verdict and the queue taken now (`LoadCollector`), then every series."""
        self.healthy()
        self.metrics.load = await self._queue_load()
        return self.metrics.render()

    async def performance(self) -> dict[str, object]:
        summary = self.metrics.performance.summary(self.settings.max_batch_size, self.scheduler.queue_depth)
        # Read where the scheduler updates it, on its loop.
        summary["cost_model"] = await self.scheduler.run(self.costs.summary, self.settings.max_batch_size,
                                                         self.clock.now())
        stats = self.cache.stats
        summary["cache"] = {"enabled": self.cache.enabled, "capacity_bytes": self.cache.capacity_bytes,
                            "bytes": self.cache.bytes_held, "entries": len(self.cache), "hits": stats.hits,
                            "misses": stats.misses, "inflight_joins": stats.joined, "evictions": stats.evictions,
                            "hit_rate": stats.hit_rate}
        summary["cache_store"] = self.store_info()  # the shared tier (--cache-store), or None
        # Per preprocessing worker: items (in reusable slots), busy and CPU seconds, restarts; [] without a pool.
        summary["preprocess_workers"] = self.preprocess_pool.stats() if self.preprocess_pool is not None else []
        return summary
