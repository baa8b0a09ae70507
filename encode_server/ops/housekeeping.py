"""Keep the process's memory and pauses in check: glibc arenas, heap trimming, and when Python's full
garbage collections run (glibc parts are no-ops elsewhere).

- glibc keeps each allocating thread's freed memory in that thread's arena, so a burst of large images
  would leave the process larger for good: `limit_arenas(n)` caps the arenas at start-up
  (`mallopt(M_ARENA_MAX)`) and `trim()` returns free pages to the system (`malloc_trim(0)`).
- A full (generation 2) collection holds the GIL for tens of milliseconds with thousands of requests in
  flight: `tune_collections()` leaves the full ones to the `Housekeeper`, and lets young collections wait
  for `YOUNG_THRESHOLD` net allocations instead of CPython's 700. The requests in flight allocate and free
  thousands of objects as they come and go; at 700 every swing of that working set started a young
  collection that found it alive and moved it on to the middle generation, to be walked again there
  (about 2% of a pinned core's time at 1,000 small requests a second, against 0.2% at 10,000).

The `Housekeeper` thread runs both chores (a full collection, then a trim: each stalls other threads
while it runs) when the server has gone idle after some work, and under unbroken load every
`busy_interval_s`. docs/OPERATIONS.md ("Memory") has the measured effect.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable

from encode_server.ops.libc import libc
from encode_server.ops.thread_names import name_os_thread

log = logging.getLogger("encode_server.ops.housekeeping")

_M_ARENA_MAX = -8  # from glibc's malloc.h
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: Generation-2 threshold that keeps CPython from starting full collections on its own.
_NEVER = 1_000_000_000
#: Net allocations of tracked objects that start a young collection (CPython's default: 700).
YOUNG_THRESHOLD = 10_000


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has `malloc_trim`), else None."""
    lib = libc()
    if lib is None:
        return None
    try:
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return lib
    except AttributeError:
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


def prefer_huge_pages() -> None:
    """Let torch's CPU allocator ask for transparent huge pages for buffers of 2 MiB and more, unless the
    operator set `THP_MEM_ALLOC_ENABLE` (torch reads it at its first large allocation; processes started
    later inherit it): a fresh camera-sized buffer then costs a page fault per 2 MiB instead of per 4 KiB
    (`/sys/kernel/mm/transparent_hugepage/enabled` must be `madvise` or `always`)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def trim() -> int:
    """Give free heap pages back to the system now; returns the bytes the resident size shrank by."""
    libc = _glibc()
    if libc is None:
        return 0
    before = resident_bytes()
    libc.malloc_trim(0)  # ctypes releases the GIL for the call
    return max(0, before - resident_bytes())


def tune_collections() -> None:
    """Young collections after `YOUNG_THRESHOLD` allocations (or the higher threshold already set), middle ones
    as CPython does, full collections left to the `Housekeeper`."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, _NEVER)


class Housekeeper:
    """A daemon thread that, every `interval_s`, checks whether the server is quiet: no request in
    flight (`busy()` false) and no resident growth since the last check (requests still arriving
    allocate before they are admitted). Quiet after work, it runs a full collection and a trim;
    under unbroken load, every `busy_interval_s`. `on_run(released_bytes, collect_s, trim_s)` hears
    of each run."""

    def __init__(self, interval_s: float, busy: Callable[[], bool] = lambda: False, busy_interval_s: float = 300.0,
                 on_run: Callable[[int, float, float], None] | None = None,
                 resident: Callable[[], int] = resident_bytes) -> None:
        self.interval_s = interval_s
        self.busy_interval_s = busy_interval_s
        self._busy = busy
        self._on_run = on_run
        self._resident = resident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start (False when the interval is 0: nothing is deferred then)."""
        if self.interval_s <= 0:
            return False
        tune_collections()
        self._thread = threading.Thread(target=self._run, name="housekeeping", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        name_os_thread()
        last_run = time.monotonic()
        last_rss = self._resident()
        worked = True  # start-up itself left garbage behind
        while not self._stop.wait(self.interval_s):
            rss = self._resident()
            growing, last_rss = rss > last_rss + (1 << 20), rss
            if self._busy() or growing:
                worked = True
                if time.monotonic() - last_run < self.busy_interval_s:
                    continue
            elif not worked:
                continue  # quiet, and nothing happened since the last run
            worked = False
            last_run = time.monotonic()
            self.run_once()
            last_rss = self._resident()

    def run_once(self) -> tuple[int, float, float]:
        """A full collection, then a trim: (bytes released, collection seconds, trim seconds)."""
        started = time.perf_counter()
        gc.collect()
        collected = time.perf_counter()
        released = trim()
        collect_s, trim_s = collected - started, time.perf_counter() - collected
        log.debug("housekeeping: full collection %.1f ms, malloc_trim released %.1f MiB in %.1f ms",
                  collect_s * 1e3, released / (1 << 20), trim_s * 1e3)
        if self._on_run is not None:
            self._on_run(released, collect_s, trim_s)
        return released, collect_s, trim_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
