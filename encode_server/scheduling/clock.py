"""The scheduler's sense of time, injectable so that its rules can be tested without sleeping.

`MonotonicClock` is the real one. A test clock offers the same two calls: `now()`, and `wait(event,
timeout)`, which returns when `event` is set or `timeout` seconds of *its* time have passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    """What the scheduler needs of time."""

    def now(self) -> float:
        """Seconds on a monotonic scale."""

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        """Return when `event` is set, or after `timeout` seconds (never, when None)."""


class MonotonicClock:
    """`time.monotonic`, and real waiting on the event loop."""

    def now(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout: float | None) -> None:
        if timeout is None:
            await event.wait()
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
