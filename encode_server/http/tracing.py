"""`TraceRequests`: the ASGI layer that starts each traced request's span (`ops.tracing`).

Mounted only when `--otlp-traces-endpoint` is set (off, the app has no such layer at all). For `POST /encode`
(answered by the native front's `EncodeFastPath`, in front of FastAPI) and `POST /v1/chat/completions` (the
vLLM front) it continues the caller's `traceparent`, sets `ops.tracing.CURRENT` for the request's task (the
service's stages add their spans to it), and ends the span with the answer's status and, for an error, its
message. Other paths pass straight through.
"""

from __future__ import annotations

from encode_server.http.error_log import describe_error_body, watched
from encode_server.ops.tracing import CURRENT, Tracing

#: (method, path) of the requests traced.
TRACED = frozenset({("POST", "/encode"), ("POST", "/v1/chat/completions")})


class TraceRequests:
    """ASGI middleware: a SERVER span per traced request (see the module docstring)."""

    def __init__(self, app, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) not in TRACED:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        trace = self.tracing.start_request(f"{method} {path}", self.tracing.context_from_headers(scope["headers"]),
                                           {"http.request.method": method, "url.path": path, "http.route": path})
        if trace is None:  # not sampled
            await self.app(scope, receive, send)
            return
        answer: list[tuple[int, bytes]] = []
        token = CURRENT.set(trace)
        try:
            await self.app(scope, receive, watched(send, lambda status, body: answer.append((status, body))))
        except BaseException as exc:
            trace.end(answer[0][0] if answer else 500, f"{type(exc).__name__}: {exc}")
            raise
        else:
            status, body = answer[0] if answer else (500, b"")
            if path == "/v1/chat/completions" and status == 200:  # the front stored or pushed the rows itself
                trace.transferred({"encoder.front": "vllm"})
            trace.end(status, describe_error_body(body)[1] if status >= 400 else None)
        finally:
            CURRENT.reset(token)
