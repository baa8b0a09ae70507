"""The ASGI app: every front's routes mounted on one FastAPI app, the server's own routes (`/health`,
`/server_info`, `/metrics`, `/v1/performance`, `/v1/load`), error bodies, the API key, traces
(`--otlp-traces-endpoint`), and a lifespan that starts and stops the `runtime.Runtime`. Every error is the JSON
body of docs/CONTRACT.md section 2 (`records.error_body`).
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import encode_server
from encode_server.http.error_log import ErrorAnswerLog
from encode_server.ops.setting_values import exempt_networks, in_networks
from encode_server.ops.settings import Settings
from encode_server.records import error_body
from encode_server.runtime import Runtime
from encode_server.service import EncoderService

#: Where the Swagger UI and ReDoc assets of /docs and /redoc are served from (this server, not a CDN).
DOCS_ASSETS = "/docs-assets"


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


def create_app(settings: Settings, adapter=None, group=None):
    """The ASGI app for `settings`; the encoder is loaded at start-up unless an `adapter` is given
    (`runtime.load_encoder` gives one, and the `group` of its other ranks)."""
    runtime = Runtime(settings, adapter, group)
    tracing = runtime.tracing  # None unless --otlp-traces-endpoint: then nothing of OpenTelemetry is loaded

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service = await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    # /docs and /redoc from assets installed with the package (fastapi-offline), never from a CDN: offline
    # (an air-gapped node, a cluster without egress) FastAPI's default pages load nothing and stay blank.
    app = FastAPIOffline(title="encode-server", version=encode_server.__version__, lifespan=lifespan,
                         static_url=DOCS_ASSETS)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    for front in runtime.fronts:
        front.mount(app)

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
        info["transport"] = runtime.transport()
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(await request.app.state.service.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/load")
    async def load(request: Request) -> JSONResponse:
        return JSONResponse((await request.app.state.service.load_report()).as_json())

    @app.get("/v1/performance")
    async def performance(request: Request) -> JSONResponse:
        return JSONResponse(await request.app.state.service.performance())

    served = app
    for front in runtime.fronts:
        served = front.wrap(served)
    if settings.api_key:
        served = ApiKeyMiddleware(served, settings.api_key, settings.metrics_require_key,
                                  exempt_networks(settings.api_key_exempt_cidrs))
    if tracing is not None:
        from encode_server.http.tracing import TraceRequests

        served = TraceRequests(served, tracing)
    return ErrorAnswerLog(served)
