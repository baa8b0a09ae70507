"""The encode path from a parsed body to a response, independent of the HTTP framework.

`EncoderService` validates a request, admits it (409 duplicate, 503 overload), decodes its items
in a thread pool, submits it to the scheduler, awaits its embedding under its deadline (504), and
builds the response. Every admitted request leaves exactly once, through `finally`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from pydantic import ValidationError

from processors import DTYPE_NAMES, EncoderAdapter

from .engine import EncoderEngine
from .health import HealthProbe
from .jobs import EncodeError, EncodeJob, EncodeOutcome
from .media import MediaError, MediaLimits, MediaLoader, parse_item
from .metrics import LoopLagMonitor, ServerMetrics
from .parallel.ranks import DataParallelReplicas, WorkerGroup
from .policy import BatchPolicy
from .scheduler import EncoderScheduler, PendingRequest
from .schemas import EncodeRequest, ReceiveUrlRequest, describe_validation_error, request_id_of
from .settings import Settings
from .transfer import DeliveryError, EmbeddingSender, Registrations, check_endpoint, endpoint_for, payload_view
from .wire import Header

log = logging.getLogger("encode_server.service")

#: Above this many bytes, base64-encoding an embedding moves off the event loop.
_INLINE_ENCODE_LIMIT = 256 * 1024


class EncoderService:
    """Everything one server process needs to answer `/encode`."""

    def __init__(self, settings: Settings, adapter: EncoderAdapter, group: WorkerGroup | None = None) -> None:
        self.settings = settings
        self.adapter = adapter
        self.group = group
        self.broken: str | None = None  # why the server can no longer encode (a tensor-parallel rank died)
        self.metrics = ServerMetrics()
        self.started_at = time.time()
        self.policy = BatchPolicy(
            max_batch_size=settings.max_batch_size,
            max_wait_s=settings.max_wait_ms / 1000.0,
            min_batch_size=settings.min_batch_size,
            hard_timeout_additional_s=settings.hard_timeout_additional_s,
            max_batch_tokens=settings.max_batch_tokens,
            dynamic_batching=settings.enable_dynamic_batching,
        )
        self._media_pool = ThreadPoolExecutor(settings.media_workers, thread_name_prefix="media")
        limits = MediaLimits(
            max_image_pixels=settings.max_image_pixels, max_fetch_bytes=settings.max_request_bytes,
            audio_sample_rate=getattr(adapter, "sampling_rate", 16000), max_audio_seconds=settings.max_audio_seconds,
            video_fps=settings.video_fps, max_video_frames=settings.max_video_frames,
            allow_private_urls=settings.allow_private_urls, allowed_local_media_dir=settings.allowed_local_media_dir,
        )
        self.media = MediaLoader(self._media_pool, limits)
        self.engine = EncoderEngine(adapter, self.metrics)
        self.scheduler = EncoderScheduler(self.engine, self.policy, self.metrics, max_in_flight=2 * settings.dp_size)
        self.sender = EmbeddingSender(settings.send_timeout_s)
        self.registrations: Registrations | None = None  # made in start(), on the event loop
        self._background: set[asyncio.Task] = set()
        self._in_flight: set[tuple[str, int]] = set()
        self.draining = False
        self._drained = asyncio.Event()
        self.health = HealthProbe(self._probe, settings.health_probe_interval_s, settings.health_probe_timeout_s)
        self._loop_lag = LoopLagMonitor(self.metrics.loop_lag)

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    async def start(self) -> None:
        await asyncio.to_thread(self.media.warmup, self.adapter.info.modalities)
        # Registrations live as long as a request may: the send timeout bounds how late one may come.
        ttl_s = self.settings.req_timeout_s + self.settings.send_timeout_s
        self.registrations = Registrations(self.sender, ttl_s=ttl_s)
        if self.group is not None:
            loop = asyncio.get_running_loop()
            if self.group.role == "dp":
                self.engine.replicas = DataParallelReplicas(self.group, loop)
            self.group.on_death(lambda worker: loop.call_soon_threadsafe(self._rank_died, worker))
        self.scheduler.start()
        self._loop_lag.start()
        self.health.verdict()  # the first probe starts now, in the background

    def _rank_died(self, worker) -> None:
        if self.group is not None and self.group.role == "dp":
            self.engine.replicas.replica_died(worker.rank)  # its batches are retried on the others
            return
        self.broken = (f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) exited; "
                       f"this server cannot encode until it is restarted")
        self.scheduler.fail_queued(self.broken)

    def healthy(self) -> tuple[bool, str]:
        """Whether `/health` should say ok, and why not."""
        if self.broken:
            verdict = (False, self.broken)
        elif self.draining:
            verdict = (False, "draining: the server is shutting down")
        elif not self.scheduler.running:
            verdict = (False, "the scheduler is not running")
        else:
            verdict = self.health.verdict()
        self.metrics.healthy.set(1 if verdict[0] else 0)
        return verdict

    async def _probe(self) -> None:
        """A tiny built-in input through decode, scheduler, processor, forward and slicing."""
        modality, data = self.adapter.sample_encoded()
        source = parse_item(base64.b64encode(data).decode("ascii"), 0, modality)
        loaded = await self.media.load(modality, [source], self.adapter.item_layout)
        job = EncodeJob(req_id="__health_probe__", part_idx=0, num_parts=1, modality=modality,
                        items=[item.decoded for item in loaded], layouts=[item.layout for item in loaded],
                        raw_items=[item.raw for item in loaded])
        pending = PendingRequest(job, time.monotonic() + self.settings.health_probe_timeout_s,
                                 asyncio.get_running_loop(), probe=True)
        self.scheduler.submit(pending)
        outcome = await pending.future
        if outcome.embedding.shape != (job.tokens, self.adapter.info.hidden_size):
            raise RuntimeError(f"probe embedding has shape {tuple(outcome.embedding.shape)}")
        if not torch.isfinite(outcome.embedding).all():
            raise RuntimeError("probe embedding holds NaN or infinite values")

    def begin_drain(self) -> None:
        """Stop admitting: new requests and /health get 503; those in flight go on."""
        self.draining = True
        if not self._in_flight:
            self._drained.set()

    async def wait_drained(self, timeout: float) -> bool:
        """True when every admitted request has left within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        self._loop_lag.stop()
        await self.health.close()
        await self.scheduler.stop()
        if self.registrations is not None:
            await self.registrations.close()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self.sender.close()
        await self.media.close()
        if self.group is not None:
            await asyncio.to_thread(self.group.stop)
        self.engine.close()
        self._media_pool.shutdown(wait=False, cancel_futures=True)

    async def encode(self, payload: Any) -> dict[str, Any]:
        """Answer one `/encode` body (already JSON-decoded). Raises `EncodeError` for any failure."""
        started = time.monotonic()
        request = self._validate(payload)
        endpoints = self._endpoints(request)
        key = (request.req_id, request.part_idx)
        if self.broken:
            self.metrics.requests_total.labels(request.modality, "503").inc()
            raise EncodeError(503, self.broken, request.req_id, headers={"Retry-After": "5"})
        if self.draining:
            self.metrics.requests_total.labels(request.modality, "503").inc()
            raise EncodeError(503, "the server is draining before shutdown", request.req_id,
                              headers={"Retry-After": "1"})
        if len(self._in_flight) >= self.settings.max_pending:
            self.metrics.requests_total.labels(request.modality, "503").inc()
            raise EncodeError(503, f"overloaded: {self.settings.max_pending} requests pending",
                              request.req_id, headers={"Retry-After": "1"})
        if key in self._in_flight:
            self.metrics.requests_total.labels(request.modality, "409").inc()
            raise EncodeError(409, f"req_id {request.req_id!r} part {request.part_idx} is already in flight",
                              request.req_id)
        self._in_flight.add(key)
        self.metrics.pending.set(len(self._in_flight))
        status = "500"
        try:
            timeout = min(request.timeout_s or self.settings.req_timeout_s, self.settings.req_timeout_s)
            deadline = started + timeout
            response = await asyncio.wait_for(self._encode_admitted(request, endpoints, deadline), timeout)
            status = "200"
            self.metrics.performance.record(time.monotonic() - started, response["batch_size"])
            return response
        except asyncio.TimeoutError:
            status = "504"
            error = EncodeError(504, f"request timed out after {timeout:g} s", request.req_id)
            self._notify_failure(request, endpoints, error)
            raise error from None
        except EncodeError as error:
            if error.status == 500 and self.broken:
                error = EncodeError(503, self.broken, request.req_id, headers={"Retry-After": "5"})
            status = str(error.status)
            if error.status != 502:
                self._notify_failure(request, endpoints, error)
            raise error from None
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            self._in_flight.discard(key)
            if self.draining and not self._in_flight:
                self._drained.set()
            self.metrics.pending.set(len(self._in_flight))
            self.metrics.requests_total.labels(request.modality, status).inc()
            elapsed = time.monotonic() - started
            self.metrics.request_duration.labels(request.modality).observe(elapsed)
            log.debug("request req_id=%s part=%d modality=%s items=%d status=%s duration_ms=%.1f",
                      request.req_id, request.part_idx, request.modality, len(request.mm_items), status,
                      elapsed * 1e3)

    def _validate(self, payload: Any) -> EncodeRequest:
        if not isinstance(payload, dict):
            raise EncodeError(400, f"the body must be a JSON object, got {type(payload).__name__}")
        try:
            request = EncodeRequest.model_validate(payload)
        except ValidationError as exc:
            raise EncodeError(400, describe_validation_error(exc), request_id_of(payload)) from None
        if not self.adapter.supports(request.modality):
            supported = ", ".join(self.adapter.info.modalities)
            raise EncodeError(400, f"model {self.adapter.info.name!r} does not encode {request.modality} "
                                   f"(it encodes: {supported})", request.req_id)
        if request.timeout_s is not None and request.timeout_s > self.settings.req_timeout_s:
            raise EncodeError(400, f"timeout_s {request.timeout_s:g} is above the server's limit of "
                                   f"{self.settings.req_timeout_s:g} s", request.req_id)
        return request

    def _endpoints(self, request: EncodeRequest) -> list[str]:
        """The `tcp://prefill_host:port` destinations a request names (400 when malformed)."""
        ports = request.embedding_port
        if ports is None and request.prefill_host is None:
            return []
        if ports is None or request.prefill_host is None:
            raise EncodeError(400, "prefill_host and embedding_port go together", request.req_id)
        ports = [ports] if isinstance(ports, int) else ports
        if not ports:
            raise EncodeError(400, "embedding_port: an empty list names no destination", request.req_id)
        try:
            return list(dict.fromkeys(endpoint_for(request.prefill_host, port) for port in ports))
        except ValueError as exc:
            raise EncodeError(400, f"prefill_host/embedding_port: {exc}", request.req_id) from None

    async def _encode_admitted(self, request: EncodeRequest, endpoints: list[str],
                               deadline: float) -> dict[str, Any]:
        decode_started = time.perf_counter()
        try:
            sources = [parse_item(raw, index, request.modality) for index, raw in enumerate(request.mm_items)]
            loaded = await self.media.load(request.modality, sources, self.adapter.item_layout)
        except MediaError as exc:
            raise EncodeError(400, str(exc), request.req_id) from None
        decode_s = time.perf_counter() - decode_started
        self.metrics.preprocess.labels(request.modality, "decode").observe(decode_s)

        job = EncodeJob(
            req_id=request.req_id, part_idx=request.part_idx, num_parts=request.num_parts,
            modality=request.modality, items=[item.decoded for item in loaded],
            layouts=[item.layout for item in loaded], preprocess_s=decode_s,
            raw_items=[item.raw for item in loaded],
        )
        pending = PendingRequest(job, deadline, asyncio.get_running_loop())
        self.scheduler.submit(pending)
        outcome = await pending.future
        outcome.timings_ms["transfer"] = await self._deliver(request, endpoints, outcome) * 1e3
        return await self._response(request, outcome)

    def _header(self, request: EncodeRequest, outcome: EncodeOutcome | None,
                error: EncodeError | None = None) -> Header:
        embedding = outcome.embedding if outcome else None
        return Header(
            req_id=request.req_id, part_idx=request.part_idx, num_parts=request.num_parts,
            modality=request.modality,
            dtype=DTYPE_NAMES[embedding.dtype] if embedding is not None else DTYPE_NAMES[self.adapter.dtype],
            shape=tuple(embedding.shape) if embedding is not None else (0, self.adapter.info.hidden_size),
            items=[layout.as_json() for layout in outcome.layouts] if outcome else [],
            error={"code": error.status, "message": error.message} if error else None,
        )

    async def _deliver(self, request: EncodeRequest, endpoints: list[str], outcome: EncodeOutcome) -> float:
        """Push the embedding to every destination; seconds spent. 502 when one does not take it."""
        started = time.perf_counter()
        destinations = list(endpoints)
        if self.registrations.wanted(request.req_id):
            try:
                destinations += await self.registrations.receivers(request.req_id, self.settings.send_timeout_s)
            except (asyncio.TimeoutError, KeyError):
                raise EncodeError(502, f"the receivers registered for {request.req_id!r} did not reach their "
                                       f"receive_count within {self.settings.send_timeout_s:g} s",
                                  request.req_id) from None
        header = self._header(request, outcome)
        if not destinations:
            if not request.return_embedding:
                self.registrations.park(request.req_id, request.part_idx, header, outcome.embedding)
            return 0.0
        try:
            sent = await self.sender.send(list(dict.fromkeys(destinations)), header.encode(),
                                          payload_view(outcome.embedding))
        except DeliveryError as exc:
            raise EncodeError(502, f"could not deliver the embedding: {exc}", request.req_id) from None
        elapsed = time.perf_counter() - started
        self.metrics.transfer.labels(request.modality).observe(elapsed)
        self.metrics.bytes_sent.inc(sent)
        return elapsed

    def _notify_failure(self, request: EncodeRequest, endpoints: list[str], error: EncodeError) -> None:
        """Tell the destinations that this request failed, so prefill ranks do not wait for it."""
        destinations = list(endpoints)
        if self.registrations.wanted(request.req_id):
            destinations += self.registrations.known_receivers(request.req_id)
        if not destinations:
            return
        task = asyncio.get_running_loop().create_task(self._send_error(destinations, request, error))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_error(self, destinations: list[str], request: EncodeRequest, error: EncodeError) -> None:
        try:
            await self.sender.send(list(dict.fromkeys(destinations)), self._header(request, None, error).encode(), b"")
        except DeliveryError as exc:
            log.warning("could not tell %s's destinations that it failed: %s", request.req_id, exc)

    async def register_receiver(self, payload: Any) -> dict[str, Any]:
        """`/scheduler_receive_url`: a prefill rank asks for a request's embedding."""
        if not isinstance(payload, dict):
            raise EncodeError(400, f"the body must be a JSON object, got {type(payload).__name__}")
        try:
            registration = ReceiveUrlRequest.model_validate(payload)
            url = check_endpoint(registration.receive_url)
            count = self.registrations.register(registration.req_id, url, registration.receive_count)
        except ValidationError as exc:
            raise EncodeError(400, describe_validation_error(exc), request_id_of(payload)) from None
        except ValueError as exc:
            raise EncodeError(400, f"receive_url: {exc}" if "receive_count" not in str(exc) else str(exc),
                              request_id_of(payload)) from None
        return {"status": "ok", "req_id": registration.req_id, "registered": count,
                "receive_count": registration.receive_count}

    async def _response(self, request: EncodeRequest, outcome: EncodeOutcome) -> dict[str, Any]:
        embedding = outcome.embedding
        response: dict[str, Any] = {
            "req_id": request.req_id,
            "part_idx": request.part_idx,
            "num_parts": request.num_parts,
            "modality": request.modality,
            "embedding_shape": list(embedding.shape),
            "dtype": DTYPE_NAMES[embedding.dtype],
            "items": [layout.as_json() for layout in outcome.layouts],
            "batch_size": outcome.batch_size,
            "timings_ms": {"queue": 0.0, "preprocess": 0.0, "encode": 0.0, "transfer": 0.0, **outcome.timings_ms},
        }
        if request.return_embedding:
            transfer_started = time.perf_counter()
            nbytes = embedding.numel() * embedding.element_size()
            if nbytes > _INLINE_ENCODE_LIMIT:
                encoded = await asyncio.to_thread(_b64_embedding, embedding)
            else:
                encoded = _b64_embedding(embedding)
            response["embedding"] = encoded
            transfer_s = time.perf_counter() - transfer_started
            response["timings_ms"]["transfer"] += transfer_s * 1e3
            self.metrics.transfer.labels(request.modality).observe(transfer_s)
            self.metrics.bytes_sent.inc(nbytes)
        return response

    def server_info(self) -> dict[str, Any]:
        info = self.adapter.info
        return {
            "settings": self.settings.public_dict(),
            "model": {"name": info.name, "family": info.family, "modalities": list(info.modalities),
                      "hidden_size": info.hidden_size, "device": str(self.adapter.device),
                      "dtype": DTYPE_NAMES[self.adapter.dtype]},
            "ranks": self.group.ranks() if self.group else [{"rank": 0, "pid": os.getpid(), "role": "tp",
                                                             "alive": True}],
            "pending": self.pending,
            "queue_depth": self.scheduler.queue_depth,
            "uptime_s": time.time() - self.started_at,
        }

    def performance(self) -> dict[str, Any]:
        return self.metrics.performance.summary(self.settings.max_batch_size, self.scheduler.queue_depth)


def _b64_embedding(embedding: torch.Tensor) -> str:
    return base64.b64encode(payload_view(embedding)).decode("ascii")
