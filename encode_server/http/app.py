"""The FastAPI app: routes, body limits, error bodies, and the model's lifetime.

Routes are thin: `/encode` reads the body under `--max-request-bytes`, decodes the JSON (off the
event loop when it is large), and races `EncoderService.encode` against the client disconnecting,
so a caller who hangs up never costs an encoder forward. Every error is the JSON body of the
docs/CONTRACT.md section 2 (`records.error_body`).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import encode_server
from encode_server.admission.schemas import EncodeRequest, ReceiveUrlRequest, request_id_of
from encode_server.http.bodies import parse_json, read_body, read_limited
from encode_server.http.error_log import ErrorAnswerLog
from encode_server.ops.setting_values import exempt_networks, in_networks
from encode_server.ops.settings import Settings
from encode_server.records import EncodeError, error_body
from encode_server.service import EncoderService
from processors import load_adapter
from processors.dtypes import DTYPE_NAMES

#: Where the Swagger UI and ReDoc assets of /docs and /redoc are served from (this server, not a CDN).
DOCS_ASSETS = "/docs-assets"

log = logging.getLogger("encode_server.http")

#: Bodies above this size are JSON-decoded in a worker thread (a 1 MiB body is ~1-2 ms of parsing: too long to
#: hold the event loop; below this a thread hop costs more than it saves).
_INLINE_JSON_LIMIT = 256 << 10
#: Largest `/scheduler_receive_url` body.
REGISTRATION_BYTES = 64 * 1024
#: Status for a request whose client went away before its answer (nginx's convention).
CLIENT_CLOSED = 499


class ApiKeyMiddleware:
    """Every path but /health and (unless `metrics_require_key`) /metrics needs `Authorization: Bearer <key>`,
    compared in constant time, except from a client address inside `exempt` (`--api-key-exempt-cidrs`: the
    networks of callers that send no key, such as SGLang's prefill ranks)."""

    def __init__(self, app, api_key: str, metrics_require_key: bool = False, exempt: tuple = ()) -> None:
        self.app = app
        self._key = api_key.encode()
        self.open_paths = frozenset({"/health"} if metrics_require_key else {"/health", "/metrics"})
        self.exempt = exempt

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths and not self._exempt(scope):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if not (hmac.compare_digest(token, self._key) and scheme.lower() == b"bearer"):
                message = "missing API key" if not given else "bad API key"
                response = JSONResponse(error_body(f"{message}: send Authorization: Bearer <key>"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _exempt(self, scope) -> bool:
        client = scope.get("client")
        return bool(self.exempt and client and in_networks(client[0], self.exempt))


def error_response(error: EncodeError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def answer_encode(service: EncoderService, limit: int, declared_length: str | None,
                        chunks: AsyncIterator[bytes], hangup: Callable[[], Awaitable[None]],
                        ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One whole `/encode` exchange: (status, JSON body, headers). The request is raced against
    `hangup`, so a client that goes away never costs an encoder forward."""
    payload: Any = None
    try:
        body = await read_limited(declared_length, chunks, limit)
        payload = await asyncio.to_thread(parse_json, body) if len(body) > _INLINE_JSON_LIMIT else parse_json(body)
        work = asyncio.ensure_future(service.encode(payload))
        gone = asyncio.ensure_future(hangup())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return CLIENT_CLOSED, error_body("client disconnected", request_id_of(payload)), {}
        return 200, work.result(), {}
    except EncodeError as error:
        if error.req_id is None:
            error.req_id = request_id_of(payload)
        return error.status, error.body(), error.headers
    except asyncio.CancelledError:
        if not service.admission.draining:
            raise
        # The server exits (a second signal) while this request is in flight: answer 503, not uvicorn's 500.
        return 503, error_body("the server is shutting down", request_id_of(payload)), {"Retry-After": "1"}
    except Exception as exc:  # a bug: still answer with the contract's error body
        if service.admission.broken:  # the server is going away under this request
            return 503, error_body(service.admission.broken, request_id_of(payload)), {"Retry-After": "5"}
        log.exception("unexpected error in /encode")
        return 500, error_body(f"internal error: {exc}", request_id_of(payload)), {}


class EncodeFastPath:
    """`POST /encode` straight from ASGI, in front of FastAPI: the hot path skips the framework's
    middleware and routing (about 2 ms of CPU per request on this machine); every other request,
    and the lifespan, go to the FastAPI app behind it."""

    def __init__(self, app: FastAPI, limit: int) -> None:
        self.app = app
        self.limit = limit

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/encode" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        declared = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)

        async def chunks():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise EncodeError(CLIENT_CLOSED, "client disconnected")
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        async def hangup() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        service = getattr(self.app.state, "service", None)
        if service is None:
            status, body, headers = 503, error_body("the encoder is starting"), {}
        else:
            status, body, headers = await answer_encode(service, self.limit, declared, chunks(), hangup)
        raw = orjson.dumps(body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                                *((k.lower().encode(), v.encode()) for k, v in headers.items())]})
        await send({"type": "http.response.body", "body": raw})


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def transport_info(state, settings: Settings) -> dict[str, Any]:
    """How rows leave this server, per consumer kind: `/server_info`'s `transport`."""
    pusher = getattr(state, "vllm_pusher", None)
    if pusher is not None:
        vllm: dict[str, Any] | None = pusher.info()
    elif settings.ec_storage:
        vllm = {"connector": "ECExampleConnector", "role": "ec_producer", "shared_storage_path": settings.ec_storage}
    else:
        vllm = None
    service = getattr(state, "service", None)
    stager = getattr(service, "stager", None)
    sglang = stager.info() if stager is not None else {"backend": settings.encoder_transfer_backend,
                                                        "wire_format": settings.wire_format}
    return {"vllm": vllm, "sglang": sglang}


def create_app(settings: Settings, adapter=None, group=None):
    """The ASGI app for `settings`; the model is built at start-up unless an `adapter` is given."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        encoder = adapter or await asyncio.to_thread(load_adapter, settings.model, settings.device, settings.dtype)
        log.info("warming up %s (one forward on a tiny input)", encoder.info.name)
        warming = time.monotonic()
        await asyncio.to_thread(encoder.warmup)
        log.info("warmed up in %.1f s; starting the scheduler", time.monotonic() - warming)
        service = EncoderService(settings, encoder, group, scheduler_thread=True)
        await service.start()
        if settings.ec_storage or settings.vllm_push:
            from encode_server.vllm_producer import VllmProducer

            app.state.vllm_producer = await asyncio.to_thread(VllmProducer.from_settings, service, settings)
        if settings.vllm_push and settings.vllm_push.connector == "ECCPUConnector":
            from encode_server.fronts.vllm_cpu import CPUConnectorProducer

            app.state.vllm_pusher = await asyncio.to_thread(CPUConnectorProducer.from_settings, settings, encoder)
            service.metrics.watch_transport(app.state.vllm_pusher)
        elif settings.vllm_push:
            from encode_server.fronts.vllm_mooncake import MooncakePusher

            app.state.vllm_pusher = await asyncio.to_thread(MooncakePusher, settings.vllm_push, encoder.info.family)
            service.metrics.watch_transport(app.state.vllm_pusher)
        if settings.encoder_transfer_backend == "mooncake":
            from encode_server.fronts.sglang_mooncake import SglangMooncakeStager

            service.stager = await asyncio.to_thread(SglangMooncakeStager.from_settings, settings, encoder)
            service.metrics.watch_transport(service.stager)
        app.state.service = service
        # The model and its libraries leave ~a million long-lived objects; frozen, full collections
        # under load stop scanning them (p99 at c=16 went from up to 290 ms to under 55 ms here).
        gc.collect()
        gc.freeze()
        log.info("ready in %.1f s: serving %s (%s) on %s in %s", time.monotonic() - encode_server.IMPORTED_AT,
                 encoder.info.name, encoder.info.family, encoder.device, DTYPE_NAMES[encoder.dtype])
        try:
            yield
        finally:
            if getattr(app.state, "vllm_producer", None) is not None:
                app.state.vllm_producer.close()
            if getattr(app.state, "vllm_pusher", None) is not None:
                app.state.vllm_pusher.close()
            if service.stager is not None:
                service.stager.close()
            await service.stop()

    # /docs and /redoc from assets installed with the package (fastapi-offline), never from a CDN: offline
    # (an air-gapped node, a cluster without egress) FastAPI's default pages load nothing and stay blank.
    app = FastAPIOffline(title="encode-server", version=encode_server.__version__, lifespan=lifespan,
                         static_url=DOCS_ASSETS)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.post("/encode", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": EncodeRequest.model_json_schema()}}}})
    async def encode(request: Request) -> Response:
        """Documented here for the OpenAPI schema; `EncodeFastPath` answers it in production."""
        status, body, headers = await answer_encode(
            request.app.state.service, settings.max_request_bytes, request.headers.get("content-length"),
            request.stream(), lambda: wait_for_disconnect(request))
        return JSONResponse(body, status_code=status, headers=headers)

    @app.post("/scheduler_receive_url", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": ReceiveUrlRequest.model_json_schema()}}}})
    async def scheduler_receive_url(request: Request) -> Response:
        payload: Any = None
        try:
            payload = parse_json(await read_body(request, REGISTRATION_BYTES,
                                                 "a registration is a small JSON object: req_id, receive_url, "
                                                 "receive_count"))
            return JSONResponse(await request.app.state.service.register_receiver(payload))
        except EncodeError as error:
            if error.req_id is None:
                error.req_id = request_id_of(payload)
            return error_response(error)

    def mooncake_stager(request: Request):
        stager = getattr(request.app.state.service, "stager", None)
        if stager is None:
            raise EncodeError(404, f"{request.url.path} is SGLang's mooncake backend's: start the server with "
                                   f"--encoder-transfer-backend mooncake")
        return stager

    async def small_json(request: Request, what: str, handler) -> Response:
        """A receiver's small JSON body through `handler`, errors as the contract's error body."""
        payload: Any = None
        try:
            payload = parse_json(await read_body(request, REGISTRATION_BYTES, f"{what} is a small JSON object"))
            return JSONResponse(await handler(payload))
        except EncodeError as error:
            if error.req_id is None:
                error.req_id = request_id_of(payload)
            return error_response(error)

    @app.post("/scheduler_receive_meta_data")
    async def scheduler_receive_meta_data(request: Request) -> Response:
        """SGLang's mooncake backend: a receiver rank pulls a part's sizes (waiting until they are known)."""
        return await small_json(request, "a pull (req_id, part_idx)",
                                lambda payload: mooncake_stager(request).sizes(payload))

    @app.post("/send")
    async def send(request: Request) -> Response:
        """SGLang's mooncake backend: write a part's rows into a receiver rank's buffer, then tell its socket."""
        return await small_json(request, "a send", lambda payload: mooncake_stager(request).send(payload))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        service: EncoderService | None = getattr(request.app.state, "service", None)
        if service is None:
            return JSONResponse({"status": "unhealthy", "message": "the encoder is starting"}, status_code=503)
        healthy, message = service.healthy()
        if not healthy:
            return JSONResponse({"status": "unhealthy", "message": message}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/server_info")
    async def server_info(request: Request) -> JSONResponse:
        info = request.app.state.service.server_info()
        info["transport"] = transport_info(request.app.state, settings)
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/performance")
    async def performance(request: Request) -> JSONResponse:
        return JSONResponse(await request.app.state.service.performance())

    from encode_server.http.openai import add_openai_routes

    add_openai_routes(app, settings)

    served = EncodeFastPath(app, settings.max_request_bytes)
    if settings.api_key:
        served = ApiKeyMiddleware(served, settings.api_key, settings.metrics_require_key,
                                  exempt_networks(settings.api_key_exempt_cidrs))
    return ErrorAnswerLog(served)
