"""Reading request bodies: under a byte limit (413 naming what raises it, as soon as it is known), and as
JSON (400 naming what is wrong). Shared by every protocol front."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request

from encode_server.records import EncodeError

#: What raises the limit of `/encode` bodies, named in its 413.
ENCODE_LIMIT_REMEDY = "--max-request-bytes raises it"


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
