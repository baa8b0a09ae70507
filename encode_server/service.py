"""The encode path from a parsed body to a response, independent of the HTTP framework.

`EncoderService` builds the components and runs each request through them, one way:
admission (validate, admit, deadline) -> media (fetch and decode each item) -> scheduler and engine
(one fused forward) -> delivery (ZMQ destinations and registrations) -> response. It also owns what
concerns the whole server: the health probe (a tiny request through the same path), server info,
draining and the death of a parallel rank.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
from pydantic import ValidationError

import encode_server
from encode_server.admission.gate import Admission
from encode_server.admission.schemas import EncodeRequest, ReceiveUrlRequest, describe_validation_error, request_id_of
from encode_server.cache.cached_encoding import CachedEncoding, cache_capacity, item_keys
from encode_server.cache.embedding_cache import EmbeddingCache
from encode_server.cache.store_client import StoreConnection, check_installed
from encode_server.cache.store_tier import StoreTier, native_namespace, row_widths, store_config
from encode_server.delivery.destinations import Delivery
from encode_server.delivery.formats import wire_format
from encode_server.delivery.sockets import EmbeddingSender, check_endpoint
from encode_server.engine import EncoderEngine
from encode_server.media.decoding import MediaError, MediaLimits
from encode_server.media.loader import LoadedItem, MediaLoader, parse_item
from encode_server.media.priority_pool import CURRENT_PRIORITY, PriorityThreadPool
from encode_server.models import EncoderAdapter, ItemLayout
from encode_server.models.dtypes import DTYPE_NAMES
from encode_server.ops.cores import usable_cores
from encode_server.ops.health import HealthProbe
from encode_server.ops.metrics import ServerMetrics
from encode_server.ops.settings import Settings
from encode_server.parallel.ranks import DataParallelReplicas, WorkerGroup
from encode_server.records import EncodedPart, EncodeError, EncodeJob, PartMeta
from encode_server.responses import encode_response
from encode_server.scheduling.clock import Clock, MonotonicClock
from encode_server.scheduling.cost_model import CostModel
from encode_server.scheduling.demand import Demand, SharedDemand
from encode_server.scheduling.overlap import AdaptiveOverlap
from encode_server.scheduling.policy import BatchPolicy
from encode_server.scheduling.scheduler import EncoderScheduler, batches_in_flight
from encode_server.scheduling.scheduler_thread import SchedulerThread

log = logging.getLogger("encode_server.service")

T = TypeVar("T")

#: The `req_id` of health probes.
PROBE_REQ_ID = "__health_probe__"
#: Set by a request whose rows are staged for their receivers to pull (`EncoderService.stager`): called with
#: its items' layouts as soon as they are known, before the forward, so receivers can size their buffers.
SIZES_KNOWN: contextvars.ContextVar[Callable[[list[Any]], None] | None] = contextvars.ContextVar(
    "sizes_known", default=None)


def awaits_registrations(request: EncodeRequest) -> bool:
    """SGLang's `zmq_to_scheduler` form: `prefill_host` without ports means its ranks will register."""
    return request.prefill_host is not None and request.embedding_port is None


def batch_policy(settings: Settings) -> BatchPolicy:
    """The dispatch policy's knobs, from the settings."""
    return BatchPolicy(
        max_batch_size=settings.max_batch_size,
        max_wait_s=0.0 if settings.adaptive_wait else settings.max_wait_ms / 1000.0,
        min_batch_size=settings.min_batch_size, hard_timeout_additional_s=settings.hard_timeout_additional_s,
        max_batch_tokens=settings.max_batch_tokens, dynamic_batching=settings.enable_dynamic_batching,
        adaptive_wait=settings.adaptive_wait,
    )


def make_preprocess_pool(settings: Settings, adapter: EncoderAdapter, limits: MediaLimits):
    """The `--preprocess-workers` pool (not started), or None: preprocessing then runs in a thread here.

    Tensor-parallel servers keep preprocessing in-process: every rank prepares the same whole batch
    and agrees on its layout, which a pool that drops a bad item alone would break."""
    from encode_server.preprocessing.pool import PreprocessPool, default_preprocess_workers

    workers = settings.preprocess_workers
    if workers < 0:
        workers = default_preprocess_workers()
    if workers == 0:
        return None
    if settings.tp_size > 1:
        log.warning("--preprocess-workers is ignored with --tp-size > 1: every rank preprocesses in-process")
        return None
    if settings.preprocess_device != "cpu":
        log.warning("--preprocess-workers is ignored with --preprocess-device %s: images are preprocessed on the "
                    "GPU in this process", settings.preprocess_device)
        return None
    import pickle

    try:
        pickle.dumps(adapter.preprocessing_copy())
    except Exception as exc:  # e.g. a family whose sizing rule is a local closure
        log.warning("--preprocess-workers %d ignored: model family %s cannot be sent to worker processes (%s); "
                    "preprocessing runs in-process", workers, adapter.info.family, exc)
        return None
    return PreprocessPool(adapter, limits, workers, item_timeout_s=settings.req_timeout_s)


class EncoderService:
    """Everything one server process needs to answer `/encode`. Must be built on the running loop.

    With `scheduler_thread` (as the server runs it) the engine and the scheduler run on an event loop of
    their own (`scheduling.scheduler_thread.SchedulerThread`), so HTTP work never delays a batch; without it, on
    this loop (the in-process tests, whose fake clock steps one loop)."""

    def __init__(self, settings: Settings, adapter: EncoderAdapter, group: WorkerGroup | None = None,
                 clock: Clock | None = None, scheduler_thread: bool = False) -> None:
        self.settings = settings
        self.adapter = adapter
        self.group = group
        self.clock = clock or MonotonicClock()
        self.metrics = ServerMetrics(modalities=adapter.info.modalities)
        self.started_at = time.time()
        self.admission = Admission(settings, adapter, self.metrics, self.clock,
                                   evict=lambda priority: self.scheduler.evict_for(priority))
        # Decoding is ordered by priority too, so an interactive request does not wait behind a flood's decodes.
        self._media_pool = PriorityThreadPool(settings.media_workers, thread_name_prefix="media")
        limits = MediaLimits.from_settings(settings, adapter)
        self.preprocess_pool = make_preprocess_pool(settings, adapter, limits)
        # With a pool, images are only opened here (header: size and pixel limit, for the layout); the
        # pool's workers decode them in full.
        self.media = MediaLoader(self._media_pool, limits, header_only_images=self.preprocess_pool is not None)
        self.cache = EmbeddingCache(cache_capacity(settings))
        self.metrics.watch_cache(self.cache)
        keys = item_keys(adapter, limits) if self.cache.enabled else None
        # The shared second tier (--cache-store): one Mooncake Store connection for the native items and
        # the vLLM producer's.
        self.store: StoreConnection | None = None
        native_store = None
        if settings.cache_store and keys is not None:
            check_installed()
            self.store = StoreConnection(store_config(settings), f"encode-server {encode_server.__version__}")
            native_store = StoreTier(self.store, native_namespace(settings, adapter, keys.fingerprint),
                                     row_widths(adapter.info), ItemLayout)
            self.metrics.watch_store(self.store)
        # The embedding cache's request path (off with --cache-bytes 0); its misses come back through
        # `_submit_shared`, ordered by the most urgent request waiting for them.
        self.cached = CachedEncoding(
            self.cache, keys, self.media, adapter.item_layout, self.metrics,
            self._submit_shared, native_store, self.clock.now) if self.cache.enabled else None
        self.engine: EncoderEngine
        self.costs = CostModel()
        self.scheduler: EncoderScheduler | SchedulerThread = (
            SchedulerThread(self._build_scheduler) if scheduler_thread else self._build_scheduler())
        self._loop_lag = {loop: self.metrics.loop_lag_monitor(loop) for loop in ("http", "scheduler")}
        # Registrations live as long as a request may: the send timeout bounds how late one may come.
        self.delivery = Delivery(EmbeddingSender(settings.send_timeout_s), wire_format(settings, adapter), self.metrics,
                                 settings.send_timeout_s, settings.req_timeout_s + settings.send_timeout_s)
        self.health = HealthProbe(self._probe, settings.health_probe_interval_s, settings.health_probe_timeout_s)
        # Called once when draining begins (`on_drain`): fronts that announced this server withdraw it.
        self._drain_listeners: list[Callable[[], None]] = []
        self._drain_told = False
        # Set by a front whose receivers pull staged rows instead of being delivered to: `publish(meta,
        # layouts)`, `stage(meta, part) -> response fields`, `fail(meta, error)`. None: delivered.
        self.stager: Any = None

    def _build_scheduler(self) -> EncoderScheduler:
        """The engine and the scheduler, on the loop they will run on (the running one)."""
        replicas = None
        if self.group is not None and self.group.role == "dp":
            replicas = DataParallelReplicas(self.group, asyncio.get_running_loop())
        self.engine = EncoderEngine(self.adapter, self.metrics, replicas, self.preprocess_pool)
        policy = batch_policy(self.settings)
        if self.engine.can_prefetch:
            # The pool prepares up to a batch's worth of queued requests ahead; a batch takes the ready ones,
            # so one batch in flight (in the forward) is enough: the next takes what is ready when it ends.
            return EncoderScheduler(self.engine, policy, self.metrics, max_in_flight=1, clock=self.clock,
                                    costs=self.costs, prefetch_limit=policy.max_batch_size)
        in_flight = batches_in_flight(self.adapter.device.type != "cpu", torch.get_num_threads(), usable_cores(),
                                      self.settings.dp_size)
        # Where preparing the next batch would contend with the forward for the cores, whether to overlap them
        # is decided by what they measure on this model and traffic (`scheduling.overlap`).
        overlap = AdaptiveOverlap(in_flight) if in_flight == 1 else None
        log.info("scheduler: up to %d batch(es) in flight%s", in_flight,
                 " to start with; then as the measured costs of preparation and forward say" if overlap else "")
        return EncoderScheduler(self.engine, policy, self.metrics, max_in_flight=in_flight, clock=self.clock,
                                costs=self.costs, overlap=overlap)

    @property
    def media_pool(self) -> PriorityThreadPool:
        """The threads that decode media (by priority), for producers that decode items themselves."""
        return self._media_pool

    @property
    def pending(self) -> int:
        return self.admission.pending

    async def start(self) -> None:
        if self.store is not None:  # refuses the start against a Store of a protocol it cannot read
            await asyncio.to_thread(self.store.start)
        await asyncio.to_thread(self.media.warmup, self.adapter.info.modalities)
        if self.preprocess_pool is not None:
            await asyncio.to_thread(self.preprocess_pool.start)
        self.delivery.start()
        if self.group is not None:
            loop = asyncio.get_running_loop()
            self.group.on_death(lambda worker: loop.call_soon_threadsafe(self._rank_died, worker))
        self.scheduler.start()
        self._loop_lag["http"].start()
        self.scheduler.call(self._loop_lag["scheduler"].start).result()  # on its loop (this one, without a thread)
        self.health.verdict()  # the first probe starts now, in the background

    async def stop(self) -> None:
        self._loop_lag["http"].stop()
        await self.scheduler.run(self._loop_lag["scheduler"].stop)
        await self.health.close()
        await self.scheduler.stop()
        await self.delivery.close()
        await self.media.close()
        if self.group is not None:
            await asyncio.to_thread(self.group.stop)
        self.engine.close()
        if self.preprocess_pool is not None:
            await asyncio.to_thread(self.preprocess_pool.close)
        self._media_pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # --- one request -----------------------------------------------------------------------------

    async def encode(self, payload: Any) -> dict[str, Any]:
        """Answer one `/encode` body (already JSON-decoded). Raises `EncodeError` for any failure."""
        request, meta, endpoints = self.admission.validate(payload)

        def tell_destinations(error: EncodeError) -> None:
            if error.status != 502:  # 502: they could not be reached
                self.delivery.notify_failure(meta, endpoints, error, awaits_registrations(request))

        return await self._admitted(request, lambda deadline: self._serve(request, meta, endpoints, deadline),
                                    tell_destinations, " (the request's timeout_s, at most --req-timeout-s)")

    async def encode_rows(self, req_id: str, modality: str, items: list[bytes], priority: int = 0) -> EncodedPart:
        """Encode items already in memory (their file bytes) through admission, the scheduler and the engine
        like any `/encode` request (batched with them), and return their rows instead of delivering them:
        the entry point of producers that store rows themselves (the vLLM front). `EncodeError` on failure."""
        request = EncodeRequest(req_id=req_id, modality=modality, mm_items=items, priority=priority)
        meta = PartMeta(req_id=req_id, part_idx=0, num_parts=1, modality=modality)

        async def rows(deadline: float) -> tuple[EncodedPart, EncodedPart]:
            part = await self._encode_items(meta, items, deadline, priority=priority)
            return part, part

        return await self._admitted(request, rows)

    async def _admitted(self, request: EncodeRequest, work: Callable[[float], Awaitable[tuple[EncodedPart, T]]],
                        on_failure: Callable[[EncodeError], None] | None = None, timeout_hint: str = "") -> T:
        """Run `work(deadline)` for an admitted request within its timeout, and return its answer. Its ticket
        records how it ended; a timeout is a 504, a 500 while a rank is down a 503; `on_failure` is told of
        every failure but a cancellation (the client went away)."""
        with self.admission.admit(request) as ticket:
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

    async def _serve(self, request: EncodeRequest, meta: PartMeta, endpoints: list[str],
                     deadline: float) -> tuple[EncodedPart, dict[str, Any]]:
        """Encode an admitted request, deliver it (or stage it for its receivers to pull), and build its
        response."""
        if self.stager is not None and not request.return_embedding:  # rows asked for inline are not staged
            # Only a job of all the part's items gives its sizes (with the cache on, a job may hold only misses).
            SIZES_KNOWN.set(lambda layouts: len(layouts) == len(request.mm_items) and
                            self.stager.publish(meta, layouts))
            try:
                part = await self._encode_items(meta, request.mm_items, deadline, priority=request.priority)
            except EncodeError as error:
                self.stager.fail(meta, error)
                raise
            extra = self.stager.stage(meta, part)
            response = await encode_response(meta, part, request.return_embedding, self.metrics,
                                             self.adapter.info.deepstack_of(meta.modality))
            return part, {**response, **extra}
        part = await self._encode_items(meta, request.mm_items, deadline, priority=request.priority)
        transfer_s = await self.delivery.deliver(meta, endpoints, part, request.return_embedding,
                                                 awaits_registrations(request))
        if transfer_s:  # 0.0: nothing was sent (parked for receivers that register later, or returned inline)
            part = part.with_timings(part.timings.with_transfer(transfer_s * 1e3))
        return part, await encode_response(meta, part, request.return_embedding, self.metrics,
                                           self.adapter.info.deepstack_of(meta.modality))

    async def _encode_items(self, meta: PartMeta, raw_items: list[Any], deadline: float,
                            probe: bool = False, priority: int = 0) -> EncodedPart:
        """Fetch and decode a part's items (each on its own), then encode them in a fused batch; with the
        embedding cache on, only the items it does not hold (health probes always go to the encoder)."""
        decode_started = time.perf_counter()
        CURRENT_PRIORITY.set(priority)  # this request's task only: its decodes queue by priority
        try:
            sources = [parse_item(raw, index, meta.modality) for index, raw in enumerate(raw_items)]
            if self.cached is not None and not probe:
                return await self.cached.encode(meta, sources, decode_started, Demand(deadline, priority))
            loaded = await self.media.load(meta.modality, sources, self.adapter.item_layout)
        except MediaError as exc:
            raise EncodeError(400, str(exc), meta.req_id) from None
        return await self._submit(meta, loaded, time.perf_counter() - decode_started, deadline, priority, probe)

    async def _submit(self, meta: PartMeta, loaded: list[LoadedItem], decode_s: float, deadline: float,
                      priority: int = 0, probe: bool = False) -> EncodedPart:
        """Queue a part's decoded items as one job and await its rows."""
        return await self.scheduler.submit(self._job(meta, loaded, decode_s, probe), deadline, priority)

    async def _submit_shared(self, meta: PartMeta, loaded: list[LoadedItem], decode_s: float,
                             waiting: SharedDemand) -> EncodedPart:
        """Queue the embedding cache's misses as one job that belongs to the requests `waiting` for it: placed
        by the most urgent of them, dropped only after the last one's deadline, and moved as they come and go."""
        urgency = waiting.urgency
        future = self.scheduler.submit(self._job(meta, loaded, decode_s), urgency.deadline, urgency.priority,
                                       urgency.expires)
        waiting.watch(lambda now: self.scheduler.reprioritize(future, now.deadline, now.priority, now.expires))
        try:
            return await future
        finally:
            waiting.watch(None)

    def _job(self, meta: PartMeta, loaded: list[LoadedItem], decode_s: float, probe: bool = False) -> EncodeJob:
        self.metrics.preprocess.labels(meta.modality, "decode").observe(decode_s)
        sizes_known = SIZES_KNOWN.get()
        if sizes_known is not None and not probe:
            sizes_known([item.layout for item in loaded])
        return EncodeJob(meta=meta, items=tuple(item.decoded for item in loaded),
                         layouts=tuple(item.layout for item in loaded), raw_items=tuple(item.raw for item in loaded),
                         decode_s=decode_s, probe=probe)

    async def register_receiver(self, payload: Any) -> dict[str, Any]:
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

    async def _probe(self) -> None:
        """A tiny built-in input through decode, scheduler, processor, forward and slicing."""
        modality, data = self.adapter.sample_encoded()
        meta = PartMeta(req_id=PROBE_REQ_ID, part_idx=0, num_parts=1, modality=modality)
        deadline = self.clock.now() + self.settings.health_probe_timeout_s
        part = await self._encode_items(meta, [base64.b64encode(data).decode("ascii")], deadline, probe=True)
        tokens = sum(layout.tokens for layout in part.layouts)
        if part.embedding.shape[0] != tokens:
            raise RuntimeError(f"probe embedding has shape {tuple(part.embedding.shape)} for {tokens} tokens")
        if not torch.isfinite(part.embedding).all():
            raise RuntimeError("probe embedding holds NaN or infinite values")

    def _rank_died(self, worker) -> None:
        if self.engine.replicas is not None:
            # Its batches are retried on the others; the replicas live on the scheduler's loop.
            self.scheduler.call(self.engine.replicas.replica_died, worker.rank)
            return
        self.admission.broken = (f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited; "
                                 f"this server cannot encode until it is restarted")
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

    def server_info(self) -> dict[str, Any]:
        info = self.adapter.info
        return {
            "version": encode_server.__version__,
            "settings": self.settings.public_dict(),
            "model": {"name": info.name, "family": info.family, "modalities": list(info.modalities),
                      "hidden_size": info.hidden_size, "deepstack": info.deepstack, "row_width": info.row_width,
                      "row_widths": {modality: info.row_width_of(modality) for modality in info.modalities},
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
        }

    def store_info(self) -> dict[str, Any] | None:
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

    async def performance(self) -> dict[str, Any]:
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
