"""One log line at info for every 4xx/5xx answer, at most a few a second.

`ErrorAnswerLog` sits outermost in the ASGI stack, so it sees every answer (the `/encode` fast path,
FastAPI's routes, the API key's 401s): for a status of 400 and above it reads the error body
(docs/CONTRACT.md section 2: `message`, `req_id`) and writes

    answered 400 to POST /encode req_id=r1: mm_items[0]: not a decodable image (unknown or corrupt format)

A flood of bad requests cannot flood the log: `LineBudget` lets `LINES_PER_SECOND` lines through per
second, counts the others, and the next line written says how many were left out. The counts by
status are in `/metrics` (`encoder_requests_total`) whatever the log shows.
"""

from __future__ import annotations

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
    """(`req_id`, message) of an error body; the raw text when it is not the contract's JSON."""
    try:
        data = orjson.loads(body)
    except ValueError:
        return None, body.decode("utf-8", "replace")
    if not isinstance(data, dict):
        return None, str(data)
    req_id = data.get("req_id")
    message = data.get("message", data.get("detail", ""))
    return (str(req_id) if req_id is not None else None), str(message)


class ErrorAnswerLog:
    """ASGI middleware: logs every answer of status 400 and above (see the module's docstring)."""

    def __init__(self, app, budget: LineBudget | None = None) -> None:
        self.app = app
        self.budget = budget or LineBudget()

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def watch(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status >= 400 and message["type"] == "http.response.body":
                if len(body) < _BODY_BYTES:
                    body.extend(message.get("body", b"")[: _BODY_BYTES - len(body)])
                if not message.get("more_body", False):
                    self.record(scope, status, bytes(body))
            await send(message)

        await self.app(scope, receive, watch)

    def record(self, scope, status: int, body: bytes) -> None:
        left_out = self.budget.take()
        if left_out is None or not log.isEnabledFor(logging.INFO):
            return
        req_id, message = describe_error_body(body)
        message = " ".join(message.split())
        if len(message) > _MESSAGE_CHARS:
            message = message[:_MESSAGE_CHARS] + "..."
        note = (f" ({left_out} more error answers were not logged: at most {self.budget.per_second} lines a second)"
                if left_out else "")
        method, path = scope.get("method", "?"), scope.get("path", "?")
        log.info("answered %d to %s %s req_id=%s: %s%s", status, method, path, req_id or "-", message, note,
                 extra={"status": status, "method": method, "path": path, "req_id": req_id})
