"""The `/encode` exchange runs in the request's own task, and a hang-up cancels that task (no second task
for the work): the answer is 499, the task is left as it was (not marked cancelled), and a cancellation
that is not the client's (the server stopping) still propagates."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest

from encode_server.fronts.native.routes import CLIENT_CLOSED, answer_encode

pytestmark = pytest.mark.quick

LIMIT = 1 << 20


class HeldService:
    """Stands in for `EncoderService`: `encode` waits until `release` is set (or it is cancelled)."""

    def __init__(self) -> None:
        self.admission = SimpleNamespace(draining=False, broken=None)
        self.release = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = False

    async def encode(self, payload):
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return {"req_id": payload["req_id"], "ok": True}


async def chunks_of(raw: bytes):
    yield raw


async def exchange(service: HeldService, hangup) -> tuple[tuple, int]:
    """Run one exchange in a task of its own; its answer and the task's pending cancellations after it."""
    async def run():
        answer = await answer_encode(service, LIMIT, None, chunks_of(orjson.dumps({"req_id": "r1"})), hangup)
        return answer, asyncio.current_task().cancelling()

    return await asyncio.create_task(run())


async def test_a_hang_up_answers_499_and_leaves_the_task_uncancelled():
    service = HeldService()
    gone = asyncio.Event()

    async def hangup() -> None:
        await service.started.wait()
        await gone.wait()

    running = asyncio.ensure_future(exchange(service, hangup))
    await service.started.wait()
    gone.set()
    (status, body, _), cancelling = await running
    assert status == CLIENT_CLOSED and body["req_id"] == "r1"
    assert service.cancelled  # the work was stopped, not left running
    assert cancelling == 0


async def test_a_finished_request_stops_watching_for_the_hang_up():
    service = HeldService()
    watching = asyncio.Event()
    stopped = asyncio.Event()

    async def hangup() -> None:
        watching.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            stopped.set()
            raise

    running = asyncio.ensure_future(exchange(service, hangup))
    await watching.wait()
    service.release.set()
    (status, body, _), cancelling = await running
    assert (status, body) == (200, {"req_id": "r1", "ok": True})
    assert cancelling == 0
    await asyncio.wait_for(stopped.wait(), 5)


async def test_a_cancellation_that_is_not_the_clients_propagates():
    service = HeldService()

    async def hangup() -> None:
        await asyncio.Event().wait()

    task = asyncio.ensure_future(answer_encode(service, LIMIT, None, chunks_of(orjson.dumps({"req_id": "r2"})),
                                               hangup))
    await service.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert service.cancelled
