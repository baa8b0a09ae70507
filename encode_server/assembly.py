"""The service's parts built from the settings, in one place, each wired to the others once: metrics,
decoding threads and the media loader, the `--preprocess-workers` pool, the embedding cache and its Mooncake
Store tier, the engine and the scheduler (on a thread of their own, or on this loop), ZMQ delivery, the
hand-over, the health probe, admission.

`runtime.Runtime` builds the server with it, passing the hand-over a front gave (chosen once, before the
service exists); the in-process tests call `build_service` with the settings and an adapter alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import torch

import encode_server
from encode_server.admission.gate import Admission
from encode_server.cache.cached_encoding import CachedEncoding, cache_capacity, item_keys
from encode_server.cache.embedding_cache import EmbeddingCache
from encode_server.cache.store_client import StoreConnection, check_installed
from encode_server.cache.store_tier import StoreTier, native_namespace, row_widths, store_config
from encode_server.delivery.destinations import Delivery
from encode_server.delivery.formats import wire_format
from encode_server.delivery.handover import Handover
from encode_server.delivery.sockets import EmbeddingSender
from encode_server.engine import EncoderEngine
from encode_server.media.decoding import MediaError, MediaLimits, decode_bytes
from encode_server.media.loader import MediaLoader
from encode_server.media.priority_pool import PriorityThreadPool
from encode_server.models import EncoderAdapter, ItemError, ItemLayout, Processor
from encode_server.ops.cores import usable_cores
from encode_server.ops.health import HealthProbe, fit_sample
from encode_server.ops.metrics import ServerMetrics
from encode_server.ops.settings import Settings
from encode_server.parallel.ranks import DataParallelReplicas, WorkerGroup
from encode_server.preprocessing.pool import PreprocessPool, default_preprocess_workers
from encode_server.scheduling.clock import Clock, MonotonicClock
from encode_server.scheduling.cost_model import CostModel
from encode_server.scheduling.overlap import AdaptiveOverlap
from encode_server.scheduling.policy import BatchPolicy
from encode_server.scheduling.scheduler import EncoderScheduler, batches_in_flight
from encode_server.scheduling.scheduler_thread import SchedulerThread
from encode_server.service import EncoderService, JobQueue, PartEncoder, ServiceParts

log = logging.getLogger("encode_server.assembly")


def batch_policy(settings: Settings) -> BatchPolicy:
    """The dispatch policy's knobs, from the settings."""
    return BatchPolicy(
        max_batch_size=settings.max_batch_size,
        max_wait_s=0.0 if settings.adaptive_wait else settings.max_wait_ms / 1000.0,
        min_batch_size=settings.min_batch_size, hard_timeout_additional_s=settings.hard_timeout_additional_s,
        max_batch_tokens=settings.max_batch_tokens, dynamic_batching=settings.enable_dynamic_batching,
        adaptive_wait=settings.adaptive_wait,
    )


def make_preprocess_pool(settings: Settings, adapter: EncoderAdapter, limits: MediaLimits) -> PreprocessPool | None:
    """The `--preprocess-workers` pool (not started), or None: preprocessing then runs in a thread here.

    Tensor-parallel servers keep preprocessing in-process: every rank prepares the same whole batch
    and agrees on its layout, which a pool that drops a bad item alone would break."""
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
    return PreprocessPool(adapter, limits, workers, item_timeout_s=settings.req_timeout_s)


def probe_sample(adapter: EncoderAdapter, limits: MediaLimits) -> tuple[str, bytes]:
    """The health probe's input: the model's sample file shrunk to within `limits` (`ops.health.fit_sample`).
    ValueError, naming the setting, when the model refuses even that (the server cannot be healthy then)."""
    modality, data = adapter.processor.sample_encoded()
    fitted = fit_sample(modality, data, limits.max_image_pixels, limits.max_audio_seconds)
    try:
        adapter.processor.item_layout(modality, decode_bytes(modality, fitted, limits, "the health probe's item"))
    except (MediaError, ItemError) as exc:
        setting = "--max-image-pixels" if modality == "image" else "--max-audio-seconds"
        raise ValueError(f"the health probe's {modality} cannot fit within {setting} and still be encoded "
                         f"({exc}); raise {setting}") from None
    return modality, fitted


def zmq_delivery(settings: Settings, adapter: EncoderAdapter, metrics: ServerMetrics) -> Delivery:
    """ZMQ delivery in `--wire-format`: the default hand-over, and `/scheduler_receive_url`'s registrations
    (they live as long as a request may: the send timeout bounds how late one may come)."""
    return Delivery(EmbeddingSender(settings.send_timeout_s), wire_format(settings, adapter), metrics,
                    settings.send_timeout_s, settings.req_timeout_s + settings.send_timeout_s)


def processor_threads(overlap_adaptive: bool, processor: Processor) -> int:
    """The engine's processor threads: two where the overlap is adaptive (two batches may be in flight, and
    then both may prepare at once) and the processor takes two callers at once; one elsewhere."""
    return 2 if overlap_adaptive and processor.concurrent_calls else 1


def build_engine_and_scheduler(settings: Settings, adapter: EncoderAdapter, group: WorkerGroup | None,
                               metrics: ServerMetrics, preprocess_pool: PreprocessPool | None, clock: Clock,
                               costs: CostModel) -> tuple[EncoderEngine, EncoderScheduler]:
    """The engine and the scheduler, on the loop they will run on (the running one)."""
    replicas = None
    if group is not None and group.role == "dp":
        replicas = DataParallelReplicas(group, asyncio.get_running_loop())
    in_flight = batches_in_flight(adapter.device.type != "cpu", torch.get_num_threads(), usable_cores(),
                                  settings.dp_size)
    adaptive = preprocess_pool is None and in_flight == 1
    # Where the overlap is adaptive it may allow two batches in flight; they may then both prepare at once,
    # preparation being the longer stage there, with a processor that takes two callers at once.
    engine = EncoderEngine(adapter, metrics, replicas, preprocess_pool,
                           processor_threads=processor_threads(adaptive, adapter.processor))
    policy = batch_policy(settings)
    if engine.can_prefetch:
        # The pool prepares up to a batch's worth of queued requests ahead; a batch takes the ready ones,
        # so one batch in flight (in the forward) is enough: the next takes what is ready when it ends.
        return engine, EncoderScheduler(engine, policy, metrics, max_in_flight=1, clock=clock, costs=costs,
                                        prefetch_limit=policy.max_batch_size)
    # Where preparing the next batch would contend with the forward for the cores, whether to overlap them
    # is decided by what they measure on this model and traffic (`scheduling.overlap`).
    overlap = AdaptiveOverlap(in_flight) if adaptive else None
    log.info("scheduler: up to %d batch(es) in flight%s", in_flight,
             " to start with; then as the measured costs of preparation and forward say" if overlap else "")
    return engine, EncoderScheduler(engine, policy, metrics, max_in_flight=in_flight, clock=clock, costs=costs,
                                    overlap=overlap)


def build_service(settings: Settings, adapter: EncoderAdapter, group: WorkerGroup | None = None, *,
                  clock: Clock | None = None, scheduler_thread: bool = False, metrics: ServerMetrics | None = None,
                  delivery: Delivery | None = None, handover: Handover | None = None) -> EncoderService:
    """The service and every part of it, not started. Must be called on the running loop.

    `scheduler_thread` (as the server runs): the engine and the scheduler on a loop and thread of their own;
    without it, on this loop (the in-process tests, whose fake `clock` steps one loop). `delivery` (built with
    `metrics`) and `handover`: what the runtime chose before the service existed; by default ZMQ delivery
    is the hand-over."""
    clock = clock or MonotonicClock()
    metrics = metrics or ServerMetrics(modalities=adapter.info.modalities)
    metrics.lanes = max(1, settings.dp_size)  # forwards side by side, for the busy fraction
    # Decoding is ordered by priority too, so an interactive request does not wait behind a flood's decodes.
    media_pool = PriorityThreadPool(settings.media_workers, thread_name_prefix="media")
    limits = MediaLimits.from_settings(settings, adapter)
    preprocess_pool = make_preprocess_pool(settings, adapter, limits)
    # With a pool, images are only opened here (header: size and pixel limit, for the layout); the pool's
    # workers decode them in full.
    media = MediaLoader(media_pool, limits, header_only_images=preprocess_pool is not None)
    cache = EmbeddingCache(cache_capacity(settings))
    metrics.watch_cache(cache)
    keys = item_keys(adapter, limits) if cache.enabled else None
    # The shared second tier (--cache-store): one Mooncake Store connection for the native items and the vLLM
    # producer's.
    store: StoreConnection | None = None
    native_store = None
    if settings.cache_store and keys is not None:
        check_installed()
        store = StoreConnection(store_config(settings), f"encode-server {encode_server.__version__}")
        native_store = StoreTier(store, native_namespace(settings, adapter, keys.fingerprint),
                                 row_widths(adapter.info), ItemLayout)
        metrics.watch_store(store)
    costs = CostModel()
    built: list[EncoderEngine] = []

    def engine_and_scheduler() -> EncoderScheduler:
        engine, scheduler = build_engine_and_scheduler(settings, adapter, group, metrics, preprocess_pool, clock,
                                                       costs)
        built.append(engine)
        return scheduler

    # A SchedulerThread builds them on its own loop before it returns.
    scheduler = SchedulerThread(engine_and_scheduler) if scheduler_thread else engine_and_scheduler()
    jobs = JobQueue(scheduler, metrics)
    # The embedding cache's request path (off with --cache-bytes 0); its misses come back through
    # `jobs.submit_shared`, ordered by the most urgent request waiting for them.
    cached = CachedEncoding(cache, keys, media, adapter.processor.item_layout, metrics, jobs.submit_shared,
                            native_store, clock.now) if keys is not None else None
    encoder = PartEncoder(adapter, media, jobs, cached, clock, probe_sample(adapter, limits))
    delivery = delivery or zmq_delivery(settings, adapter, metrics)
    parts = ServiceParts(
        adapter=adapter, group=group, clock=clock, metrics=metrics,
        admission=Admission(settings, adapter, metrics, clock, evict=scheduler.evict_for),
        media_pool=media_pool, media=media, preprocess_pool=preprocess_pool, cache=cache, store=store,
        cached=cached, engine=built[0], costs=costs, scheduler=scheduler, encoder=encoder, delivery=delivery,
        handover=handover or delivery,
        health=HealthProbe(functools.partial(encoder.probe, settings.health_probe_timeout_s),
                           settings.health_probe_interval_s, settings.health_probe_timeout_s),
        loop_lag={loop: metrics.loop_lag_monitor(loop) for loop in ("http", "scheduler")})
    return EncoderService(settings, parts)
