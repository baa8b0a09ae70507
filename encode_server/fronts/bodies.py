"""Reading request bodies: under a byte limit (413 naming what raises it, as soon as it is known), and as
JSON (400 naming what is wrong); small JSON bodies answered with the contract's error body. Shared by every
protocol front."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from encode_server.admission.schemas import request_id_of
from encode_server.records import EncodeError

#: What raises the limit of `/encode` bodies, named in its 413.
ENCODE_LIMIT_REMEDY = "--max-request-bytes raises it"
#: Largest body of the small JSON exchanges (a receiver's registration, pull or send).
SMALL_BODY_BYTES = 64 * 1024


async def read_limited(declared: str | None, chunks: AsyncIterator[bytes], limit: int,
                       remedy: str = ENCODE_LIMIT_REMEDY) -> bytes:
    """A request body, refused with 413 as soon as it is known to exceed `limit` bytes; the 413's message
    ends with `remedy`."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise EncodeError(400, f"bad Content-Length header {declared!r}") from None
        if size > limit:
            raise EncodeError(413, f"request body of {size} bytes is above the limit of {limit} bytes ({remedy})")
    parts: list[bytes] = []
    received = 0
    async for chunk in chunks:
        received += len(chunk)
        if received > limit:
            raise EncodeError(413, f"request body is above the limit of {limit} bytes ({remedy})")
        parts.append(chunk)
    return b"".join(parts)


async def read_body(request: Request, limit: int, remedy: str = ENCODE_LIMIT_REMEDY) -> bytes:
    return await read_limited(request.headers.get("content-length"), request.stream(), limit, remedy)


def parse_json(body: bytes) -> Any:
    if not body:
        raise EncodeError(400, "empty body: expected a JSON object")
    try:
        return orjson.loads(body)
    except (ValueError, RecursionError) as exc:  # orjson.JSONDecodeError is a ValueError
        raise EncodeError(400, f"body is not valid JSON: {str(exc)[:200]}") from None


#: Bodies above this size are JSON-decoded in a worker thread: parsing a large body would hold the event loop
#: (every other request waits), while for a small one the thread hop costs more than the parsing.
INLINE_JSON_LIMIT = 256 << 10


async def parse_json_body(body: bytes) -> Any:
    """`parse_json`, in a thread for a body over `INLINE_JSON_LIMIT`."""
    return await asyncio.to_thread(parse_json, body) if len(body) > INLINE_JSON_LIMIT else parse_json(body)


def error_response(error: EncodeError) -> JSONResponse:
    """The contract's error body (docs/CONTRACT.md section 2) with the error's status and headers."""
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def small_json(request: Request, remedy: str, handler: Callable[[Any], Awaitable[Any]]) -> JSONResponse:
    """A small JSON body (at most `SMALL_BODY_BYTES`; a 413 ends with `remedy`) through `handler`; errors as the
    contract's error body, with the body's `req_id` when it has one."""
    payload: Any = None
    try:
        payload = parse_json(await read_body(request, SMALL_BODY_BYTES, remedy))
        return JSONResponse(await handler(payload))
    except EncodeError as error:
        if error.req_id is None:
            error.req_id = request_id_of(payload)
        return error_response(error)
