"""`POST /encode` and `/scheduler_receive_url`: the native front.

`/encode` is thin: it reads the body under `--max-request-bytes`, decodes the JSON (off the event loop when
it is large), and races `EncoderService.encode` against the client disconnecting, so a caller who hangs up
never costs an encoder forward. `EncodeFastPath` answers it straight from ASGI; the FastAPI route of the same
path documents it in the OpenAPI schema. Every error is the JSON body of docs/CONTRACT.md section 2.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from encode_server.admission.schemas import EncodeRequest, ReceiveUrlRequest, request_id_of
from encode_server.fronts.base import Front
from encode_server.fronts.bodies import parse_json_body, read_limited, small_json
from encode_server.records import EncodeError, error_body
from encode_server.service import EncoderService

log = logging.getLogger("encode_server.fronts.native.routes")

#: Status for a request whose client went away before its answer (nginx's convention).
CLIENT_CLOSED = 499


async def answer_encode(service: EncoderService, limit: int, declared_length: str | None,
                        chunks: AsyncIterator[bytes], hangup: Callable[[], Awaitable[None]],
                        ) -> tuple[int, dict[str, object], dict[str, str]]:
    """One whole `/encode` exchange: (status, JSON body, headers). The request is raced against
    `hangup`, so a client that goes away never costs an encoder forward."""
    payload: object = None
    hung_up = False
    try:
        body = await read_limited(declared_length, chunks, limit)
        payload = await parse_json_body(body)
        # The work runs in this task and a watcher cancels it when the client hangs up: one task per request
        # besides this one, where racing two tasks cost two and a waiter.
        task = asyncio.current_task()

        async def watch() -> None:
            nonlocal hung_up
            await hangup()
            hung_up = True
            task.cancel()

        gone = asyncio.get_running_loop().create_task(watch())
        try:
            return 200, await service.encode(payload), {}
        finally:
            gone.cancel()
            if hung_up:  # the cancellation was the watcher's (answered below, or swallowed by the work)
                task.uncancel()
    except EncodeError as error:
        if error.req_id is None:
            error.req_id = request_id_of(payload)
        return error.status, error.body(), error.headers
    except asyncio.CancelledError:
        if hung_up:
            return CLIENT_CLOSED, error_body("client disconnected", request_id_of(payload)), {}
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
    middleware and routing (CPU spent on every request for nothing it uses); every other request,
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


class NativeFront(Front):
    """The routes of docs/CONTRACT.md; the service is the app's (`app.state.service`, set once it runs)."""

    def __init__(self, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes

    def mount(self, app: FastAPI) -> None:
        limit = self.max_request_bytes

        @app.post("/encode", openapi_extra={"requestBody": {
            "required": True, "content": {"application/json": {"schema": EncodeRequest.model_json_schema()}}}})
        async def encode(request: Request) -> Response:
            """Documented here for the OpenAPI schema; `EncodeFastPath` answers it in production."""
            status, body, headers = await answer_encode(
                request.app.state.service, limit, request.headers.get("content-length"),
                request.stream(), lambda: wait_for_disconnect(request))
            return JSONResponse(body, status_code=status, headers=headers)

        @app.post("/scheduler_receive_url", openapi_extra={"requestBody": {
            "required": True, "content": {"application/json": {"schema": ReceiveUrlRequest.model_json_schema()}}}})
        async def scheduler_receive_url(request: Request) -> Response:
            return await small_json(request, "a registration is a small JSON object: req_id, receive_url, "
                                             "receive_count", request.app.state.service.register_receiver)

    def wrap(self, asgi: FastAPI) -> EncodeFastPath:
        return EncodeFastPath(asgi, self.max_request_bytes)
