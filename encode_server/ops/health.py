"""The real health probe: a tiny input through the whole encode path, its verdict cached.

`/health` never waits for the probe: it reads the last verdict and, when that is older than
`interval_s` and no probe is running, starts a new one in the background. So an idle server that
nobody asks spends nothing, and a server behind a long batch still answers at once. A probe that
fails, or that has not finished after `timeout_s`, makes the server unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("encode_server.ops.health")


class HealthProbe:
    """Runs `probe` at most every `interval_s`; `verdict()` says healthy or why not."""

    def __init__(self, probe: Callable[[], Awaitable[None]], interval_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._task: asyncio.Task | None = None
        self._started_at = 0.0
        self._finished_at: float | None = None
        self._error: str | None = None

    def _start(self) -> None:
        self._started_at = self._clock()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            await asyncio.wait_for(self._probe(), self.timeout_s)
            self._error = None
        except asyncio.TimeoutError:
            self._error = f"the health probe did not finish within {self.timeout_s:g} s"
        except Exception as exc:  # any failure of the encode path makes the server unhealthy
            self._error = f"the health probe failed: {exc}"
        if self._error:
            log.warning("%s", self._error)
        self._finished_at = self._clock()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def verdict(self) -> tuple[bool, str]:
        """(healthy, message) from the cached result; refreshes it in the background when stale."""
        now = self._clock()
        if self.running:
            if now - self._started_at > self.timeout_s:
                return False, f"the health probe has not finished after {now - self._started_at:.1f} s"
        elif self._finished_at is None or now - self._finished_at >= self.interval_s:
            self._start()
        if self._finished_at is None:
            return True, "first probe running"
        if self._error:
            return False, self._error
        return True, "ok"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
