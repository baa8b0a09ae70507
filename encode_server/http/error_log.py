"""One log line at info for every 4xx/5xx answer, at most a few a second.

`ErrorAnswerLog` sits outermost in the ASGI stack, so it sees every answer (the `/encode` fast path,
FastAPI's routes, the API key's 401s): for a status of 400 and above it reads the error body
(docs/CONTRACT.md section 2: `message`, `req_id`) and writes

    answered 400 to POST /encode req_id=r1: mm_items[0]: not a decodable image (unknown or corrupt format)

A flood of bad requests cannot flood the log: `LineBudget` lets `LINES_PER_SECOND` lines through per
second and counts the others; a second after the first line left out (a one-shot timer on the loop), or
as the server stops (`flush`), one line says how many were: `(45 more error answers were not logged: at
most 10 lines a second)`. The counts by status are in `/metrics` (`encoder_requests_total`) whatever the
log shows.

The vLLM front's OpenAI-style error bodies (`{"error": {"message": ...}}`) are read too; their request is
named by its `x-request-id` header.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import orjson

log = logging.getLogger("encode_server.http.errors")

#: Most error lines written in one second.
LINES_PER_SECOND = 10
#: Most bytes of an error body read for its message.
_BODY_BYTES = 4096
_MESSAGE_CHARS = 300


class LineBudget:
    """At most `per_second` lines in each one-second window; counts the lines it refuses."""

    def __init__(self, per_second: int = LINES_PER_SECOND, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_second = per_second
        self.clock = clock
        self._window_start = float("-inf")
        self._used = 0
        self._suppressed = 0

    def left_out(self) -> int:
        """The lines left out since the last line written or the last call; the count starts again."""
        left_out, self._suppressed = self._suppressed, 0
        return left_out

    def take(self) -> int | None:
        """None: leave this line out. Otherwise write it: the number of lines left out since the last one."""
        now = self.clock()
        if now - self._window_start >= 1.0:
            self._window_start, self._used = now, 0
        if self._used >= self.per_second:
            self._suppressed += 1
            return None
        self._used += 1
        left_out, self._suppressed = self._suppressed, 0
        return left_out


def describe_error_body(body: bytes) -> tuple[str | None, str]:
    """(`req_id`, message) of an error body: the contract's (`message`, `req_id`), or the OpenAI-style one of the
    vLLM front (`{"error": {"message": ...}}`); the raw text when it is neither."""
    try:
        data = orjson.loads(body)
    except ValueError:
        return None, body.decode("utf-8", "replace")
    if not isinstance(data, dict):
        return None, str(data)
    req_id = data.get("req_id")
    error = data.get("error")
    if isinstance(error, dict) and "message" in error:
        message = error["message"]
    else:
        message = data.get("message", data.get("detail", ""))
    return (str(req_id) if req_id is not None else None), str(message)


def request_id_header(scope) -> str | None:
    """The request's `x-request-id` header (how vLLM's proxy names a request), or None."""
    value = next((value for name, value in scope.get("headers", ()) if name == b"x-request-id"), None)
    return value.decode("latin-1") if value is not None else None


def watched(send, done: Callable[[int, bytes], None]):
    """`send`, and `done(status, body)` once the answer's last body message has gone: the body (its first
    `_BODY_BYTES`) for a status of 400 and above, empty below."""
    status = 0
    body = bytearray()

    async def watch(message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            if status >= 400 and len(body) < _BODY_BYTES:
                body.extend(message.get("body", b"")[: _BODY_BYTES - len(body)])
            if not message.get("more_body", False):
                done(status, bytes(body))
        await send(message)

    return watch


class ErrorAnswerLog:
    """ASGI middleware: logs every answer of status 400 and above (see the module's docstring)."""

    def __init__(self, app, budget: LineBudget | None = None, report_after_s: float = 1.0) -> None:
        self.app = app
        self.budget = budget or LineBudget()
        self.report_after_s = report_after_s  # from the first line left out to the line that counts them
        self._flush: asyncio.TimerHandle | None = None  # the one-shot timer that reports lines left out

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        def done(status: int, body: bytes) -> None:
            if status >= 400:
                self.record(scope, status, body)

        await self.app(scope, receive, watched(send, done))

    def flush(self) -> None:
        """One line saying how many error answers were left out since the last line, if any were."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        left_out = self.budget.left_out()
        if left_out and log.isEnabledFor(logging.INFO):
            log.info("(%d more error answers were not logged: at most %d lines a second)", left_out,
                     self.budget.per_second, extra={"left_out": left_out})

    def record(self, scope, status: int, body: bytes) -> None:
        left_out = self.budget.take()
        if left_out is None:
            if self._flush is None:  # the count is told in a second, even if no other error answer comes
                self._flush = asyncio.get_running_loop().call_later(self.report_after_s, self.flush)
            return
        if not log.isEnabledFor(logging.INFO):
            return
        req_id, message = describe_error_body(body)
        req_id = req_id or request_id_header(scope)  # an OpenAI-style body names no request: its header does
        message = " ".join(message.split())
        if len(message) > _MESSAGE_CHARS:
            message = message[:_MESSAGE_CHARS] + "..."
        note = (f" ({left_out} more error answers were not logged: at most {self.budget.per_second} lines a second)"
                if left_out else "")
        method, path = scope.get("method", "?"), scope.get("path", "?")
        log.info("answered %d to %s %s req_id=%s: %s%s", status, method, path, req_id or "-", message, note,
                 extra={"status": status, "method": method, "path": path, "req_id": req_id})
