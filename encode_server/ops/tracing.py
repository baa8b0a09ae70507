"""OpenTelemetry traces (`--otlp-traces-endpoint`): a caller's W3C `traceparent` continued through each stage
of its request, exported over OTLP/HTTP (protobuf) from the SDK's background batch processor.

Off by default, and then nothing here imports `opentelemetry` or allocates anything: `CURRENT` (a context
variable) stays None and each stage's hook is one `CURRENT.get()` and a None test. On, `Tracing` is built once
at start-up (`tracing_for(settings)`); the HTTP layer (`http.tracing.TraceRequests`) starts a `RequestTrace` for
each sampled `POST /encode` and `POST /v1/chat/completions` from its `traceparent` header, and a gRPC front
does the same from its call's metadata (`call_traced(tracing, "SglangEncoder/Encode", metadata, work)`).

How a request maps to spans. The request's SERVER span is a child of the caller's span (a root when no
`traceparent` came). Its stages are its children: `admission` (from the request's arrival, body read and
validation included, to its admission), `decode` (fetching and decoding its items; the cache's misses only,
with the cache on), `cache` (hashing, the local and the Store tiers, and waiting for the misses; attributes say
which tier served each item), `queue` (from its job's submission to the batch's dispatch), `preprocess` and
`forward` (its batch's), `delivery` (ZMQ to its destinations) or `transfer` (the vLLM front's storage write or
push, from the last rows to the answer). A forward serves many requests at once; it is
modelled both ways: each request gets its own `queue`/`preprocess`/`forward` spans, timed from the `BatchInfo`
the engine records (`batch.id`, size, items, tokens as attributes), and the engine emits one `batch` span per
forward that served a traced request, a root of its own, linked to every traced request's span, which each
request's `forward` span links back to. So a caller's trace shows where its own time went without leaving its
trace, and the batch span shows who shared the forward: links are the OpenTelemetry way to say "one operation
served several traces"; a batch span as the child of one request would belong to that request's trace alone.
The stage spans are made after the fact, with their measured start and end times (`time.perf_counter`,
converted to the epoch): the engine and the scheduler run on their own thread, where no request's context is.

Spans go to the SDK's `BatchSpanProcessor`: `span.end()` only queues the span; a thread of the SDK exports
them, so the event loops never wait for the collector.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import encode_server

T = TypeVar("T")

#: The trace of the request this task serves (set by the HTTP or gRPC front when tracing is on and the
#: request is sampled); None otherwise, always when tracing is off.
CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("encoder_trace", default=None)

#: The engine's span for one forward (a root; always recorded: it exists only for a sampled request).
BATCH_SPAN = "batch"
#: How often the background processor exports, unless `OTEL_BSP_SCHEDULE_DELAY` says otherwise.
EXPORT_DELAY_MS = 1000


def parse_traces_endpoint(text: str) -> str:
    """`--otlp-traces-endpoint`: an OTLP/HTTP collector, `http(s)://HOST:PORT[/PATH]` (`HOST:PORT` means http://;
    without a path, the OTLP default `/v1/traces` is added)."""
    value = text.strip()
    if "://" not in value:
        value = "http://" + value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an OTLP/HTTP collector URL such as http://127.0.0.1:4318, got {text!r} "
                         f"(traces are sent as OTLP over HTTP with protobuf, not over gRPC)")
    if parts.path in ("", "/"):
        value = value.rstrip("/") + "/v1/traces"
    return value


def libraries_needed(settings: Any) -> list[tuple[str, str]]:
    """The optional library tracing needs (the `otel` extra: the OTLP/HTTP exporter, which brings the SDK), and
    what asks for it, for `runtime.check_libraries`; none when tracing is off."""
    return [("opentelemetry", "--otlp-traces-endpoint")] if settings.otlp_traces_endpoint else []


def tracing_for(settings: Any) -> Tracing | None:
    """The server's `Tracing` for its settings, or None when `--otlp-traces-endpoint` is not set."""
    if not settings.otlp_traces_endpoint:
        return None
    return Tracing(settings.otlp_traces_endpoint, settings.otlp_traces_sample_ratio)


def _carrier(pairs: Iterable[tuple[Any, Any]]) -> dict[str, str]:
    """The W3C trace headers among `pairs` (str or bytes, any case), as the propagator reads them."""
    found = {}
    for key, value in pairs:
        name = (key.decode("latin-1") if isinstance(key, bytes) else str(key)).lower()
        if name in ("traceparent", "tracestate"):
            found[name] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return found


def context_from_metadata(metadata: Mapping[str, Any] | Iterable[tuple[Any, Any]]) -> Any:
    """The caller's OpenTelemetry context from gRPC metadata: a mapping, or the `(key, value)` pairs that
    `ServicerContext.invocation_metadata()` gives (keys in any case, values str or bytes); an empty context
    without a `traceparent`. For a traced server only (it imports OpenTelemetry's propagator)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    return TraceContextTextMapPropagator().extract(_carrier(pairs))


async def call_traced(tracing: Tracing | None, name: str, metadata: Mapping[str, Any] | Iterable[tuple[Any, Any]],
                      work: Callable[[], Awaitable[T]]) -> T:
    """`await work()` as one traced request of a front outside HTTP (a gRPC call: `name` its method, `metadata`
    its invocation metadata, whose `traceparent` it continues); just `await work()` when `tracing` is None or
    the call is not sampled. The span ends with status 200, or the HTTP status an `EncodeError` carries."""
    if tracing is None:
        return await work()
    trace = tracing.start_request(name, context_from_metadata(metadata), {"rpc.system": "grpc", "rpc.method": name})
    if trace is None:
        return await work()
    token = CURRENT.set(trace)
    try:
        answer = await work()
    except BaseException as exc:
        status = getattr(exc, "status", 500)  # an EncodeError's HTTP status (records sits beside ops, not below)
        trace.end(status if isinstance(status, int) else 500, getattr(exc, "message", None) or repr(exc))
        raise
    else:
        trace.end(200)
        return answer
    finally:
        CURRENT.reset(token)


class Tracing:
    """The tracer, its exporter and processor, and the two kinds of spans this server makes."""

    def __init__(self, endpoint: str, sample_ratio: float = 1.0, service_name: str | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = endpoint
        self._Link, self._SpanKind, self._Status, self._StatusCode = Link, SpanKind, Status, StatusCode
        self._in_context = set_span_in_context
        self._propagator = TraceContextTextMapPropagator()
        resource = Resource.create({"service.name": service_name or os.environ.get("OTEL_SERVICE_NAME",
                                                                                   "encode-server"),
                                    "service.version": encode_server.__version__})
        # Not the global provider: FastAPI traces through the global one when it is set, and its spans are not ours.
        self.provider = TracerProvider(resource=resource, sampler=_sampler(sample_ratio))
        delay = None if os.environ.get("OTEL_BSP_SCHEDULE_DELAY") else EXPORT_DELAY_MS
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                            schedule_delay_millis=delay))
        self.tracer = self.provider.get_tracer("encode_server", encode_server.__version__)
        self._epoch_offset_ns = time.time_ns() - time.perf_counter_ns()

    def epoch_ns(self, perf_s: float) -> int:
        """A `time.perf_counter()` reading as nanoseconds since the epoch (what spans are timed in)."""
        return int(perf_s * 1e9) + self._epoch_offset_ns

    def context_from_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> Any:
        """The caller's context from an ASGI scope's headers (`traceparent`, `tracestate`); empty without them."""
        return self._propagator.extract(_carrier(headers))

    def start_request(self, name: str, parent: Any, attributes: dict[str, Any] | None = None,
                      started: float | None = None) -> RequestTrace | None:
        """The SERVER span of one request, child of `parent` (a context from `context_from_*`); None when the
        sampler drops it (nothing more is recorded for that request)."""
        started = time.perf_counter() if started is None else started
        span = self.tracer.start_span(name, context=parent, kind=self._SpanKind.SERVER, attributes=attributes,
                                      start_time=self.epoch_ns(started))
        if not span.is_recording():
            return None
        return RequestTrace(self, span, started)

    def batch_span(self, batch: Any, traced: Sequence[RequestTrace], req_ids: Sequence[str]) -> Any:
        """Emit the `batch` span of one forward (`records.BatchInfo`), linked to the `traced` requests' spans;
        return `batch` with the span's context (which each request's `forward` span links to)."""
        import dataclasses

        links = [self._Link(trace.span.get_span_context()) for trace in traced]
        span = self.tracer.start_span(BATCH_SPAN, kind=self._SpanKind.INTERNAL, links=links,
                                      start_time=self.epoch_ns(batch.dispatched), attributes={
                                          "encoder.batch.id": batch.batch_id, "encoder.modality": batch.modality,
                                          "encoder.batch.size": batch.size, "encoder.batch.items": batch.items,
                                          "encoder.batch.tokens": batch.tokens, "encoder.batch.where": batch.where,
                                          "encoder.batch.req_ids": list(req_ids),
                                          "encoder.batch.preprocess_ms": (batch.preprocess[1] - batch.preprocess[0])
                                          * 1e3,
                                          "encoder.batch.forward_ms": (batch.forward[1] - batch.forward[0]) * 1e3})
        span.end(end_time=self.epoch_ns(batch.forward[1]))
        return dataclasses.replace(batch, span=span.get_span_context())

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop the processor's thread. Blocking:
        call it off the event loop."""
        self.provider.shutdown()


class RequestTrace:
    """One sampled request's SERVER span, and its stages as children (see the module docstring)."""

    __slots__ = ("tracing", "span", "context", "started", "rows_at")

    def __init__(self, tracing: Tracing, span: Any, started: float) -> None:
        self.tracing = tracing
        self.span = span
        self.context = tracing._in_context(span)
        self.started = started
        self.rows_at: float | None = None  # when its last rows came back (`encoded`)

    def stage(self, name: str, start: float, end: float, attributes: dict[str, Any] | None = None,
              links: Sequence[Any] = ()) -> None:
        """A child span from `start` to `end` (`time.perf_counter` seconds)."""
        span = self.tracing.tracer.start_span(name, context=self.context, attributes=attributes, links=links,
                                              start_time=self.tracing.epoch_ns(start))
        span.end(end_time=self.tracing.epoch_ns(end))

    def admitted(self, req_id: str, modality: str, items: int, priority: int) -> None:
        """The request passed admission: its `admission` span (from its arrival), and what it is, on the
        request's span."""
        self.span.set_attributes({"encoder.req_id": req_id, "encoder.modality": modality, "encoder.items": items,
                                  "encoder.priority": priority})
        self.stage("admission", self.started, time.perf_counter(), {"encoder.req_id": req_id})

    def encoded(self, part: Any, since: float, req_id: str) -> None:
        """Its rows are here (`records.EncodedPart`): the `cache` span (from `since`, with the cache on), and
        `queue`, `preprocess` and `forward` from the batch it joined (none when every item came from a cache,
        or from another request's computation)."""
        now = self.rows_at = time.perf_counter()
        rows = int(part.embedding.shape[0])
        self.span.set_attribute("encoder.rows", rows)
        if part.cache_tiers:
            tiers = [tier or "miss" for tier in part.cache_tiers]
            self.stage("cache", since, now, {"encoder.req_id": req_id, "encoder.cache.tiers": tiers,
                                             "encoder.cache.local_hits": tiers.count("local"),
                                             "encoder.cache.store_hits": tiers.count("store"),
                                             "encoder.cache.misses": tiers.count("miss")})
        batch = part.batch
        if batch is None:
            return
        joined = {"encoder.req_id": req_id, "encoder.batch.id": batch.batch_id, "encoder.batch.size": batch.size}
        self.stage("queue", batch.dispatched - part.timings.queue / 1e3, batch.dispatched, joined)
        self.stage("preprocess", *batch.preprocess, {**joined, "encoder.batch.where": batch.where})
        links = [self.tracing._Link(batch.span)] if batch.span is not None else []
        self.stage("forward", *batch.forward, {**joined, "encoder.batch.items": batch.items,
                                               "encoder.batch.tokens": batch.tokens, "encoder.rows": rows}, links)

    def delivered(self, start: float, destinations: int, transfer_ms: float) -> None:
        """The `delivery` span: the rows sent to (or parked for) the request's destinations."""
        self.stage("delivery", start, time.perf_counter(), {"encoder.destinations": destinations,
                                                            "encoder.transfer_ms": transfer_ms})

    def transferred(self, attributes: dict[str, Any] | None = None) -> None:
        """The `transfer` span of a front that hands the rows over itself (the vLLM front: its storage write or
        its connector's push): from its last rows to now."""
        if self.rows_at is not None:
            self.stage("transfer", self.rows_at, time.perf_counter(), attributes)

    def end(self, status: int, message: str | None = None) -> None:
        """End the request's span with its HTTP status (an error status from 500 up, as OpenTelemetry's HTTP
        conventions have it for a server; the message of any error answer as `encoder.error`)."""
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_attribute("error.type", str(status))
            if message:
                self.span.set_attribute("encoder.error", message)
        if status >= 500:
            self.span.set_status(self.tracing._Status(self.tracing._StatusCode.ERROR, message))
        self.span.end()


def _sampler(ratio: float) -> Any:
    """A request follows its caller's sampling decision, or `ratio` of the trace ids when it starts a trace;
    a batch span is always kept (it exists only for a sampled request)."""
    from opentelemetry.sdk.trace.sampling import (
        Decision,
        ParentBased,
        Sampler,
        SamplingResult,
        TraceIdRatioBased,
    )

    class EncoderSampler(Sampler):
        def __init__(self) -> None:
            self.requests = ParentBased(TraceIdRatioBased(ratio))

        def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                          trace_state=None):
            if name == BATCH_SPAN:
                return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)
            return self.requests.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"EncoderSampler(requests: {self.requests.get_description()}, batches: always)"

    return EncoderSampler()
