"""The media decode pool runs waiting work highest priority first (read from the request's context)."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from encode_server.media.priority_pool import CURRENT_PRIORITY, PriorityThreadPool

pytestmark = pytest.mark.quick


def test_waiting_work_runs_highest_priority_first_then_in_order():
    pool = PriorityThreadPool(1)
    gate, ran = threading.Event(), []
    blocker = pool.submit(gate.wait)
    futures = []
    for name, priority in [("low-1", 0), ("high", 2), ("low-2", 0), ("mid", 1)]:
        context = contextvars.copy_context()
        context.run(CURRENT_PRIORITY.set, priority)
        futures.append(context.run(pool.submit, ran.append, name))
    gate.set()
    for future in [blocker, *futures]:
        future.result(timeout=5)
    assert ran == ["high", "mid", "low-1", "low-2"]
    pool.shutdown()


def test_errors_reach_the_caller_and_shutdown_cancels_waiting_work():
    pool = PriorityThreadPool(1)
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=5)
    gate = threading.Event()
    pool.submit(gate.wait)
    waiting = pool.submit(lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert waiting.cancelled()
    with pytest.raises(RuntimeError):
        pool.submit(print)
    gate.set()


async def test_run_in_executor_uses_the_priority_of_the_calling_task():
    pool = PriorityThreadPool(1)
    loop = asyncio.get_running_loop()
    gate, ran = threading.Event(), []
    blocked = loop.run_in_executor(pool, gate.wait)

    async def decode(name: str, priority: int) -> None:
        CURRENT_PRIORITY.set(priority)
        await loop.run_in_executor(pool, ran.append, name)

    tasks = [asyncio.ensure_future(decode("offline", 0)), asyncio.ensure_future(decode("interactive", 1))]
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(blocked, *tasks)
    assert ran == ["interactive", "offline"]
    assert CURRENT_PRIORITY.get() == 0  # the tasks' settings never leaked out
    pool.shutdown()
