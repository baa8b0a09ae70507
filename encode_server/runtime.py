"""The running server, built from the settings in one place: the CLI (`__main__`) and the tests' in-process
servers both use it.

`load_encoder` comes first, before the app exists: the device, the model (a Hub id becomes its local folder),
the parallel ranks, the adapter, tensor parallelism and preprocessing on the device. `Runtime` is the rest,
which the app's lifespan runs on the serving loop: `start` warms the model up, chooses the hand-over once
(ZMQ delivery, or the one a front's receivers need), has `assembly.build_service` build the service around
it, starts the service and every front, and freezes what is alive by then out of the garbage collector's
full collections; `stop` closes the fronts, then the service.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import encode_server
from encode_server.assembly import build_service, probe_sample, zmq_delivery
from encode_server.cache.store_client import libraries_needed as store_libraries
from encode_server.delivery.destinations import Delivery
from encode_server.delivery.handover import Handover
from encode_server.fronts.base import Front
from encode_server.fronts.native.routes import NativeFront
from encode_server.fronts.sglang.front import SglangFront
from encode_server.fronts.vllm.front import VllmFront
from encode_server.media.decoding import MediaLimits
from encode_server.models import DTYPE_NAMES, EncoderAdapter
from encode_server.ops.libraries import MissingLibrary, require
from encode_server.ops.metrics import ServerMetrics
from encode_server.ops.settings import Settings
from encode_server.ops.tracing import Tracing, tracing_for
from encode_server.ops.tracing import libraries_needed as tracing_libraries
from encode_server.parallel.ranks import WorkerGroup
from encode_server.service import EncoderService

log = logging.getLogger("encode_server.startup")

T = TypeVar("T")


class StartError(Exception):
    """The server cannot start with these settings; the message names what is wrong and the fix."""


def check_libraries(settings: Settings) -> None:
    """Every optional library these settings ask for is installed: each component that needs one says which
    (the shared cache tier, the SGLang front's mooncake backend, traces), and a missing one is a `StartError` in
    one line naming what asked for it and the install, before the model loads. (The settings check values only.)"""
    for library, wanted_by in (*store_libraries(settings), *SglangFront.libraries_needed(settings),
                               *tracing_libraries(settings)):
        try:
            require(library, wanted_by)
        except MissingLibrary as exc:
            raise StartError(str(exc)) from None


def interruptibly(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a daemon thread while the calling thread waits in short timed waits, so that Ctrl-C or
    SIGTERM ends a start that is blocked in it at once: Python runs a signal's handler in the main thread only
    when that thread returns to Python code, which a socket read without a timeout (a Hub that accepts and
    never answers) or a download library's native code never does, and the kernel may deliver the signal to
    another thread (a BLAS pool's) so that the read is not interrupted either. The daemon thread dies with the
    process."""
    outcome: dict[str, object] = {}
    done = threading.Event()

    def work() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller, as a direct call would raise it
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=work, name="model-fetch", daemon=True).start()
    while not done.wait(0.1):
        pass
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def load_encoder(settings: Settings) -> tuple[EncoderAdapter, WorkerGroup | None]:
    """The model this server encodes with, on its device, and the group of its other ranks (None with one
    rank): started, loaded and, with `--tp-size`, sharded. `StartError` if it cannot be."""
    from encode_server.models import DeviceError, load_adapter, resolve_model
    from encode_server.models.base import resolve_device
    from encode_server.models.registry import ModelNotFound

    world = max(settings.tp_size, settings.dp_size)
    try:
        device = resolve_device(settings.device, world)
    except DeviceError as exc:
        raise StartError(str(exc)) from None
    try:  # a Hub id becomes its local encoder-only folder here, downloaded once for every rank
        log.info("resolving model %s", settings.model)
        model = interruptibly(resolve_model, settings.model)
    except ModelNotFound as exc:  # the message names the model and what it should be
        raise StartError(str(exc)) from None
    except (ValueError, OSError) as exc:
        raise StartError(f"cannot load model {settings.model!r}: {exc}") from None
    group = None
    if world > 1:
        log.info("starting %d %s ranks", world - 1, "tensor-parallel" if settings.tp_size > 1 else "data-parallel")
        group = WorkerGroup(dataclasses.replace(settings, model=model), "tp" if settings.tp_size > 1 else "dp", world)
        group.start()  # the other ranks load the model while this one does
    try:
        log.info("loading model %s on %s (dtype %s)", settings.model, device, settings.dtype)
        loading = time.monotonic()
        adapter = load_adapter(model, settings.device, settings.dtype,
                               name=settings.model if model != settings.model else None)
        log.info("loaded %s (family %s, %s) in %.1f s", adapter.info.name, adapter.info.family,
                 DTYPE_NAMES[adapter.dtype], time.monotonic() - loading)
        if group is not None and group.role == "tp":
            from encode_server.parallel.ranks import join_tensor_parallel

            adapter = join_tensor_parallel(adapter, group)
        if settings.preprocess_device != "cpu":
            from encode_server.preprocessing.gpu import PreprocessDeviceError, use_device_preprocessing

            try:
                use_device_preprocessing(adapter, settings.preprocess_device)
            except PreprocessDeviceError as exc:
                raise StartError(str(exc)) from None
        try:  # before "ready": a server whose own health probe cannot pass would never become ready
            probe_sample(adapter, MediaLimits.from_settings(settings, adapter))
        except ValueError as exc:
            raise StartError(str(exc)) from None
    except (ValueError, OSError) as exc:  # CheckpointError and ShardingError are ValueErrors
        if group is not None:
            group.stop()
        if isinstance(exc, ModelNotFound):  # the message names the model and what it should be
            raise StartError(str(exc)) from None
        raise StartError(f"cannot load model {settings.model!r}: {exc}") from None
    except StartError:
        if group is not None:
            group.stop()
        raise
    return adapter, group


def fronts_for(settings: Settings, tracing: Tracing | None = None) -> list[Front]:
    """Every protocol front, in the order their routes are mounted and they start (closed in reverse); SGLang's
    gRPC encoder service with `--grpc-port` (grpcio is imported only then: it is an optional extra), which
    continues its calls' traces with `tracing`. A front reads its own settings here: `StartError` names one it
    cannot honour."""
    try:
        fronts: list[Front] = [NativeFront(settings.max_request_bytes), SglangFront(settings), VllmFront(settings)]
    except ValueError as exc:
        raise StartError(str(exc)) from None
    if settings.grpc_port is not None:
        from encode_server.fronts.sglang.grpc_front import SglangGrpcFront

        fronts.append(SglangGrpcFront(settings, tracing))
    return fronts


class Runtime:
    """The service and the fronts of one server, around the encoder `load_encoder` gave (loaded by `start`
    when none is given)."""

    def __init__(self, settings: Settings, adapter: EncoderAdapter | None = None,
                 group: WorkerGroup | None = None) -> None:
        check_libraries(settings)
        self.settings = settings
        self.adapter = adapter
        self.group = group
        # Traces (--otlp-traces-endpoint), None when off: the HTTP layer and the gRPC front start requests' spans.
        self.tracing = tracing_for(settings)
        self.fronts = fronts_for(settings, self.tracing)
        self.service: EncoderService | None = None

    async def start(self) -> EncoderService:
        """Warm up, start the service and the fronts; the service, ready to answer."""
        if self.adapter is None:
            self.adapter, self.group = await asyncio.to_thread(load_encoder, self.settings)
        encoder = self.adapter
        log.info("warming up %s (one forward on a tiny input)", encoder.info.name)
        warming = time.monotonic()
        await asyncio.to_thread(encoder.warmup)
        log.info("warmed up in %.1f s; starting the scheduler", time.monotonic() - warming)
        metrics = ServerMetrics(modalities=encoder.info.modalities)
        delivery = zmq_delivery(self.settings, encoder, metrics)
        service = build_service(self.settings, encoder, self.group, scheduler_thread=True, metrics=metrics,
                                delivery=delivery, handover=await self.handover(encoder, delivery))
        await service.start()
        self.service = service
        for front in self.fronts:
            await front.start(service)
        # The model and its libraries leave a great many long-lived objects; frozen, the full collections
        # that run under load no longer scan them (each scan is a pause of every request in flight).
        gc.collect()
        gc.freeze()
        log.info("ready in %.1f s: serving %s (%s) on %s in %s", time.monotonic() - encode_server.IMPORTED_AT,
                 encoder.info.name, encoder.info.family, encoder.device, DTYPE_NAMES[encoder.dtype])
        return service

    async def handover(self, encoder: EncoderAdapter, delivery: Delivery) -> Handover:
        """The one hand-over of every request: a front's, when its receivers need one (at most one front may
        give one), else ZMQ `delivery`."""
        chosen: list[tuple[Front, Handover]] = []
        for front in self.fronts:
            offered = await front.handover(encoder, delivery)
            if offered is not None:
                chosen.append((front, offered))
        if len(chosen) > 1:
            raise StartError(f"two fronts each need the hand-over of every request "
                             f"({', '.join(type(front).__name__ for front, _ in chosen)}): enable one of them")
        return chosen[0][1] if chosen else delivery

    async def stop(self) -> None:
        """Close the fronts (last started first), then the service (its ranks and workers with it); then export
        the spans still queued (off the loop)."""
        for front in reversed(self.fronts):
            await front.close()
        if self.service is not None:
            await self.service.stop()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)

    def transport(self) -> dict[str, object]:
        """`/server_info`'s `transport`: how rows leave this server, per consumer kind."""
        found: dict[str, object] = {}
        for front in self.fronts:
            found.update(front.transport())
        return found
