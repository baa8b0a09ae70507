"""Calls posted from any thread, run in order on one event loop: how the HTTP loop and the scheduler's loop
talk (`scheduler_thread.SchedulerThread`), one wake-up for however many messages arrived meanwhile."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("encode_server.scheduling.mailbox")


class Mailbox:
    """Calls posted from any thread, run in order on one loop.

    By default the first post after a drain wakes the loop to run them all (one wake-up however many
    were posted meanwhile). A consumer that drains the box itself (`EncoderScheduler`, before each
    decision) passes `wake`, and says with `listen` before it sleeps whether posts should wake it: the
    scheduler does not need waking for arrivals while it has no room for a batch, which on a busy server
    is most of the time, and each wake-up of another thread costs a system call and a thread switch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None] | None = None) -> None:
        self.loop = loop
        self._wake = wake or self.run_pending
        self._calls: list[tuple[Callable[..., None], tuple]] = []
        self._lock = threading.Lock()
        self._listening = True
        self._woken = False

    def __len__(self) -> int:
        return len(self._calls)

    def post(self, fn: Callable[..., None], *args: Any, urgent: bool = False) -> None:
        """Queue `fn(*args)`; wake the loop if it listens (or the call is `urgent`) and is not woken yet."""
        with self._lock:
            self._calls.append((fn, args))
            if self._woken or not (self._listening or urgent):
                return
            self._woken = True
        self.loop.call_soon_threadsafe(self._wake)

    def run_pending(self) -> None:
        """Run what was posted (on the loop)."""
        with self._lock:
            calls, self._calls = self._calls, []
            self._woken = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:  # one bad call must not stop the loop that runs the others (the scheduler's)
                log.exception("posted call %r failed", fn)

    def listen(self, wake_on_post: bool) -> bool:
        """Before the consumer sleeps: False when calls are waiting (run them first); otherwise remember
        whether the next post should wake it. Under the lock, so no post slips between check and sleep."""
        with self._lock:
            if self._calls:
                return False
            self._listening = wake_on_post
            return True

    def take(self) -> list[tuple[Callable[..., None], tuple]]:
        """Empty the box without running it (its loop has stopped)."""
        with self._lock:
            calls, self._calls = self._calls, []
        return calls
