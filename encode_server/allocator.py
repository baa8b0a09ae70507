"""Keep the C heap from holding on to memory the server no longer uses (glibc; a no-op elsewhere).

Every thread that allocates (media decoding, the processor, the forward, torch's pool, libzmq) gets
a glibc malloc arena, and glibc keeps an arena's freed memory for reuse instead of returning it to
the system: after a burst of large images the process stays hundreds of MiB larger for good (issue
15, measured with `scripts/rss_soak.py`). Two remedies, both off the hot path:

- `limit_arenas(n)` caps the number of arenas (`mallopt(M_ARENA_MAX, n)`) at start-up, before the
  worker threads exist, so freed memory is shared among fewer heaps;
- `MallocTrimmer` returns free pages to the system (`malloc_trim(0)`, which `madvise`s away the free
  pages of every arena) from a background thread. Memory freed after a burst does not change the
  resident size, so no growth test can tell when to trim; and a trim holds each arena's lock while it
  walks it (5-100 ms here), stalling any thread that allocates meanwhile, the event loop included.
  So it trims when the server is idle (checked every `interval_s`), and under unbroken load at most
  every `busy_interval_s`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("encode_server.allocator")

_M_ARENA_MAX = -8  # from glibc's malloc.h
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has `malloc_trim`), else None."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def resident_bytes() -> int:
    """This process's resident set size, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


def limit_arenas(count: int) -> bool:
    """Cap glibc's malloc arenas (0 leaves glibc's default of 8 per core). True when applied."""
    libc = _glibc()
    if count <= 0 or libc is None:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))


def trim() -> int:
    """Give free heap pages back to the system now; returns the bytes the resident size shrank by."""
    libc = _glibc()
    if libc is None:
        return 0
    before = resident_bytes()
    libc.malloc_trim(0)
    return max(0, before - resident_bytes())


class MallocTrimmer:
    """A daemon thread that trims once the server went idle (`busy()` false at a check every
    `interval_s`, after requests or resident growth since the last check), or after `busy_interval_s`
    of unbroken load;
    `on_trim(bytes_released, seconds)` hears of each trim."""

    def __init__(self, interval_s: float, busy: Callable[[], bool] = lambda: False, busy_interval_s: float = 300.0,
                 on_trim: Callable[[int, float], None] | None = None) -> None:
        self.interval_s = interval_s
        self.busy_interval_s = busy_interval_s
        self._busy = busy
        self._on_trim = on_trim
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start trimming (False where there is no glibc, or the interval is 0)."""
        if self.interval_s <= 0 or _glibc() is None:
            return False
        self._thread = threading.Thread(target=self._run, name="malloc-trim", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        last_trim = time.monotonic()
        last_rss = resident_bytes()
        active = True  # start-up itself left garbage behind
        while not self._stop.wait(self.interval_s):
            rss = resident_bytes()
            active = active or rss > last_rss + (1 << 20)  # work came and went between two checks
            last_rss = rss
            if self._busy():
                active = True
                if time.monotonic() - last_trim < self.busy_interval_s:
                    continue
            elif not active:
                continue  # idle, and nothing happened since the last trim
            active = False
            last_trim = time.monotonic()
            started = time.perf_counter()
            released = trim()  # ctypes drops the GIL for the call: the event loop keeps running
            elapsed = time.perf_counter() - started
            last_rss = resident_bytes()
            log.debug("malloc_trim released %.1f MiB in %.1f ms", released / (1 << 20), elapsed * 1e3)
            if self._on_trim is not None:
                self._on_trim(released, elapsed)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
