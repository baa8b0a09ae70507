"""Traces (`--otlp-traces-endpoint`, `ops.tracing`): a real server sends its spans to a real OTLP/HTTP receiver on
loopback, which decodes them with `opentelemetry-proto`'s classes; a caller's `traceparent` on `/encode` and on the
vLLM route is continued, every stage has its span under the request's, and the forward's batch span is linked
both ways. With tracing off, nothing of OpenTelemetry's SDK is loaded while the server serves."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import importlib.abc
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import zmq

from encode_server.ops import libraries
from encode_server.ops.settings import load_settings
from encode_server.ops.tracing import Tracing, call_traced, context_from_metadata, parse_traces_endpoint
from encode_server.records import EncodeError
from encode_server.runtime import StartError, check_libraries
from tests.support.helpers import InProcessServer, Pull, free_port, image_b64, png_bytes
from tests.support.vllm_requests import data_url, image_part, proxy_body

STAGES = ("admission", "decode", "cache", "queue", "preprocess", "forward", "delivery")


class OtlpReceiver:
    """`POST /v1/traces` on a loopback port: each body decoded as an `ExportTraceServiceRequest`; the spans kept."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list = []
        self.resources: list[dict] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                receiver.paths.append(self.path)
                for resource_spans in request.resource_spans:
                    receiver.resources.append(attributes(resource_spans.resource))
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of_trace(self, trace_id: str) -> list:
        return [span for span in self.spans if span.trace_id.hex() == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 10.0) -> dict:
        """The spans of `trace_id` by name, once every one of `names` has arrived."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = {span.name: span for span in self.of_trace(trace_id)}
            if names <= set(found):
                return found
            time.sleep(0.05)
        raise AssertionError(f"spans of {trace_id}: {sorted(found)}, expected {sorted(names)}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(item) -> dict:
    out = {}
    for pair in item.attributes:
        value = pair.value
        kind = value.WhichOneof("value")
        out[pair.key] = ([getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
                         if kind == "array_value" else getattr(value, kind))
    return out


def traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = OtlpReceiver()
    storage = tmp_path_factory.mktemp("ec")
    # The exporter's round every 100 ms instead of every second: the spans arrive sooner (read as the processor
    # is built, at the server's start).
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        with InProcessServer("--otlp-traces-endpoint", receiver.url, "--cache-bytes", "64MiB",
                             "--ec-storage", str(storage), "--grpc-port", str(free_port())) as server:
            yield server, receiver
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        receiver.close()


def test_an_encode_continues_the_callers_trace_with_a_span_per_stage(traced):
    server, receiver = traced
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        response = httpx.post(server.url + "/encode", headers={"traceparent": traceparent(trace_id, caller)},
                              json={"req_id": "traced-1", "modality": "image", "mm_items": [image_b64(56, 56, seed=7)],
                                    "prefill_host": "127.0.0.1", "embedding_port": port}, timeout=60)
        assert response.status_code == 200, response.text
        assert pull.poll(10_000), "the rows never reached the receiver"
    finally:
        pull.close(linger=0)
    spans = receiver.wait_for(trace_id, {"POST /encode", *STAGES})
    request = spans["POST /encode"]
    assert request.parent_span_id.hex() == caller and request.kind == request.SPAN_KIND_SERVER
    assert attributes(request) | {"encoder.req_id": "traced-1", "encoder.modality": "image", "encoder.items": 1,
                                  "http.response.status_code": 200} == attributes(request)
    for name in STAGES:
        stage = spans[name]
        assert stage.parent_span_id == request.span_id, name
        assert request.start_time_unix_nano <= stage.start_time_unix_nano <= stage.end_time_unix_nano, name
        assert stage.end_time_unix_nano <= request.end_time_unix_nano, name
    assert attributes(spans["cache"])["encoder.cache.tiers"] == ["miss"]
    assert attributes(spans["delivery"])["encoder.destinations"] == 1
    forward = attributes(spans["forward"])
    assert forward["encoder.batch.size"] >= 1 and forward["encoder.batch.tokens"] > 0
    assert forward["encoder.rows"] == attributes(request)["encoder.rows"] > 0
    assert spans["queue"].end_time_unix_nano <= spans["preprocess"].start_time_unix_nano
    assert spans["preprocess"].end_time_unix_nano <= spans["forward"].end_time_unix_nano
    # The forward's batch span: a root of its own, linked to this request's span; the request's forward links it.
    (link,) = spans["forward"].links
    batch = next(span for span in receiver.spans if span.span_id == link.span_id)
    assert batch.name == "batch" and not batch.parent_span_id
    assert attributes(batch)["encoder.batch.id"] == forward["encoder.batch.id"]
    assert "traced-1" in attributes(batch)["encoder.batch.req_ids"]
    assert any(link.span_id == request.span_id and link.trace_id.hex() == trace_id for link in batch.links)
    assert receiver.resources[0]["service.name"] == "encode-server"
    assert set(receiver.paths) == {"/v1/traces"}

    # The same image again: the local cache answers; no queue, no forward.
    again = "5bf92f3577b34da6a3ce929d0e0e4736"
    response = httpx.post(server.url + "/encode", headers={"traceparent": traceparent(again, caller)},
                          json={"req_id": "traced-2", "modality": "image", "mm_items": [image_b64(56, 56, seed=7)],
                                "return_embedding": True}, timeout=60)
    assert response.status_code == 200, response.text
    spans = receiver.wait_for(again, {"POST /encode", "admission", "cache"})
    assert attributes(spans["cache"])["encoder.cache.local_hits"] == 1
    assert not {"queue", "forward", "decode"} & set(spans)


def test_the_vllm_route_and_an_error_answer_are_traced_and_an_unsampled_caller_is_not(traced):
    server, receiver = traced
    trace_id, caller = "6bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    body = proxy_body(image_part(data_url(png_bytes(64, 48, seed=11))))
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"traceparent": traceparent(trace_id, caller), "x-request-id": "vllm-traced"})
    assert response.status_code == 200, response.text
    spans = receiver.wait_for(trace_id, {"POST /v1/chat/completions", "admission", "decode", "cache", "queue",
                                         "preprocess", "forward", "transfer"})
    request = spans["POST /v1/chat/completions"]
    assert request.parent_span_id.hex() == caller
    stages = [name for name in STAGES if name != "delivery"] + ["transfer"]
    assert all(spans[name].parent_span_id == request.span_id for name in stages)
    assert spans["forward"].end_time_unix_nano <= spans["transfer"].start_time_unix_nano
    assert spans["transfer"].end_time_unix_nano <= request.end_time_unix_nano
    assert attributes(spans["admission"])["encoder.req_id"].startswith("vllm-traced#")

    unsampled = "8bf92f3577b34da6a3ce929d0e0e4736"
    response = httpx.post(server.url + "/encode", headers={"traceparent": traceparent(unsampled, caller, False)},
                          json={"req_id": "quiet", "modality": "image", "mm_items": [image_b64(40, 40)],
                                "return_embedding": True}, timeout=60)
    assert response.status_code == 200
    failed = "7bf92f3577b34da6a3ce929d0e0e4736"
    response = httpx.post(server.url + "/encode", headers={"traceparent": traceparent(failed, caller)},
                          json={"req_id": "bad", "modality": "image", "mm_items": ["bm90IGFuIGltYWdl"]}, timeout=60)
    assert response.status_code == 400
    spans = receiver.wait_for(failed, {"POST /encode", "admission"})
    error = attributes(spans["POST /encode"])
    assert error["http.response.status_code"] == 400 and "not a decodable image" in error["encoder.error"]
    # Spans are exported in the order they end: those of the request sent first would be here by now.
    assert receiver.of_trace(unsampled) == []


def test_the_traces_endpoint_and_the_missing_extra_are_told_in_one_line(monkeypatch, capsys):
    assert parse_traces_endpoint("127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert parse_traces_endpoint("https://collector:4318/custom") == "https://collector:4318/custom"
    with pytest.raises(ValueError, match="OTLP/HTTP collector URL"):
        parse_traces_endpoint("grpc://collector:4317")
    with pytest.raises(SystemExit):
        load_settings(["--otlp-traces-endpoint", "http://127.0.0.1:4318", "--otlp-traces-sample-ratio", "2"], {})
    assert "--otlp-traces-sample-ratio must be in 0..1" in capsys.readouterr().err
    check_libraries(load_settings([], {}))  # off: nothing asked of the library
    monkeypatch.setattr(libraries, "load_problem", lambda library: "not installed")
    with pytest.raises(StartError) as refused:
        check_libraries(load_settings([], {"ENCODER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318"}))
    message = str(refused.value)
    assert "\n" not in message and "--otlp-traces-endpoint needs the opentelemetry library" in message
    assert "pip install -e '.[otel]'" in message, message


def test_a_grpc_encode_continues_the_metadatas_trace(traced):
    """SGLang's gRPC `Encode` with a `traceparent` in its metadata: the same spans as `/encode`, under the call's."""
    import grpc
    from smg_grpc_proto import sglang_encoder_pb2 as pb
    from smg_grpc_proto import sglang_encoder_pb2_grpc as pb_grpc

    server, receiver = traced
    trace_id, caller = "cbf92f3577b34da6a3ce929d0e0e4736", "30f067aa0ba902b7"
    address = httpx.get(server.url + "/server_info").json()["transport"]["grpc"]["address"]
    pull = Pull()
    try:
        with grpc.insecure_channel(address) as channel:
            pb_grpc.SglangEncoderStub(channel).Encode(
                pb.EncodeRequest(mm_items=[image_b64(56, 56, seed=13)], req_id="grpc-traced", num_parts=1,
                                 prefill_host="127.0.0.1", embedding_port=[pull.port]),
                metadata=[("traceparent", traceparent(trace_id, caller))], timeout=60)
        pull.receive()
    finally:
        pull.close()
    spans = receiver.wait_for(trace_id, {"SglangEncoder/Encode", *STAGES})
    call = spans["SglangEncoder/Encode"]
    assert call.parent_span_id.hex() == caller and attributes(call)["rpc.system"] == "grpc"
    assert attributes(call)["http.response.status_code"] == 200
    assert all(spans[name].parent_span_id == call.span_id for name in STAGES)
    assert attributes(spans["delivery"])["encoder.destinations"] == 1


def test_call_traced_ends_an_error_with_its_status_and_is_a_plain_call_with_tracing_off(traced):
    _, receiver = traced
    trace_id, caller = "abf92f3577b34da6a3ce929d0e0e4736", "20f067aa0ba902b7"
    tracing = Tracing(receiver.url + "/v1/traces")

    async def failing() -> None:
        raise EncodeError(400, "mm_items[0]: not a decodable image")

    metadata = (("traceparent", traceparent(trace_id, caller)), ("authorization", "Bearer k"))
    with pytest.raises(EncodeError):
        asyncio.run(call_traced(tracing, "SglangEncoder/Encode", metadata, failing))
    assert asyncio.run(call_traced(None, "SglangEncoder/Encode", metadata, lambda: asyncio.sleep(0, "ok"))) == "ok"
    tracing.shutdown()  # exports what is queued
    (span,) = receiver.of_trace(trace_id)
    assert span.name == "SglangEncoder/Encode" and span.parent_span_id.hex() == caller
    assert attributes(span)["rpc.system"] == "grpc" and attributes(span)["http.response.status_code"] == 400


def test_grpc_metadata_gives_the_callers_context():
    context = context_from_metadata((("traceparent", traceparent("4bf92f3577b34da6a3ce929d0e0e4736",
                                                                      "00f067aa0ba902b7")), ("x-other", "1")))
    from opentelemetry.trace import get_current_span

    span_context = get_current_span(context).get_span_context()
    assert f"{span_context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert f"{span_context.span_id:016x}" == "00f067aa0ba902b7" and span_context.is_remote


class _RefuseOpenTelemetry(importlib.abc.MetaPathFinder):
    """Records (and fails) any import of OpenTelemetry's SDK, exporters, protobuf classes or propagators."""

    PREFIXES = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto", "opentelemetry.propagators",
                "opentelemetry.trace.propagation.tracecontext")

    def __init__(self) -> None:
        self.refused: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name.startswith(self.PREFIXES):
            self.refused.append(name)
            raise ImportError(f"{name} imported with tracing off")
        return None


@contextlib.contextmanager
def opentelemetry_refused():
    finder = _RefuseOpenTelemetry()
    stashed = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith(finder.PREFIXES)}
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(stashed)


def test_with_tracing_off_nothing_of_opentelemetrys_sdk_is_loaded():
    """FastAPI itself imports OpenTelemetry's API (its own telemetry, a no-op without a provider); the server
    loads nothing more of it unless --otlp-traces-endpoint is set."""
    assert "ENCODER_OTLP_TRACES_ENDPOINT" not in os.environ
    with opentelemetry_refused() as finder:
        with InProcessServer("--cache-bytes", "0") as server:
            response = httpx.post(server.url + "/encode", json={"req_id": "off", "modality": "image",
                                                                "mm_items": [image_b64(40, 40)]},
                                  headers={"traceparent": traceparent("9bf92f3577b34da6a3ce929d0e0e4736",
                                                                      "00f067aa0ba902b7")}, timeout=60)
            assert response.status_code == 200, response.text
        assert finder.refused == []
        assert not [name for name in sys.modules if name.startswith(finder.PREFIXES)]
