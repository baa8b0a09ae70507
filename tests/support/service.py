"""The service in-process on a fake clock (`started_service`), and the requests its tests send (`body`, each
with an image of its own so that no cache answers it)."""

from __future__ import annotations

import asyncio
import contextlib
import zlib

from encode_server.assembly import build_service
from encode_server.ops.settings import Settings
from tests.support.fakes import FakeClock
from tests.support.helpers import image_b64

#: Holds every request (min batch never reached) until the fake clock passes 2.5 + 0.5 s; the embedding
#: cache off. `holding` runs the same tests in the default configuration too (the cache on), each request
#: with an image of its own (`body`), so every one of them reaches the encoder's queue.
HOLDING = Settings(max_wait_ms=2500, min_batch_size=1000, hard_timeout_additional_s=0.5, max_pending=3,
                   req_timeout_s=20, max_request_bytes=200_000, cache_bytes=0)


def image_of(req_id: str) -> str:
    """An image of the request's own (distinct media per request: the cache shares nothing between them)."""
    return image_b64(56, 56, seed=zlib.crc32(req_id.encode()))


def body(req_id: str, **extra) -> dict:
    return {"req_id": req_id, "modality": "image", "mm_items": [image_of(req_id)], **extra}


@contextlib.asynccontextmanager
async def started_service(settings: Settings, adapter):
    """A started service on a fake clock, and the clock; the first health probe has already run."""
    clock = FakeClock()
    service = build_service(settings, adapter, clock=clock)
    await service.start()
    try:
        for _ in range(200):  # the first probe runs through the real encoder threads
            if not service.health.running:
                break
            await asyncio.sleep(0.01)
        yield service, clock
    finally:
        await service.stop()
