"""Memory housekeeping, in-process: arenas, trimming freed heap pages back to the system,
full garbage collections deferred to quiet moments, and when the housekeeper runs."""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import pytest

from encode_server.ops import housekeeping as memory

pytestmark = pytest.mark.quick

glibc_only = pytest.mark.skipif(memory._glibc() is None, reason="malloc_trim and mallopt are glibc's")


@glibc_only
def test_trim_gives_freed_heap_pages_back():
    libc = memory._glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunk, count = 64 << 10, 2000  # 64 KiB: below the mmap threshold, so from the heap
    blocks = [libc.malloc(chunk) for _ in range(2 * count)]
    for block in blocks:
        ctypes.memset(block, 1, chunk)  # touch every page
    memory.trim()
    before = memory.resident_bytes()
    for block in blocks[::2]:  # free every other block: holes, not a free top the heap shrinks by itself
        libc.free(block)
    freed_but_kept = memory.resident_bytes()
    released = memory.trim()
    try:
        assert before - freed_but_kept < (count * chunk) // 4  # glibc kept the holes
        assert released >= (count * chunk) // 2  # trim gave most of them back
    finally:
        for block in blocks[1::2]:
            libc.free(block)


@glibc_only
def test_limit_arenas_applies_on_glibc_and_zero_leaves_the_default():
    assert memory.limit_arenas(0) is False
    assert memory.limit_arenas(8) is True  # 8 is harmless for the test process


def test_full_collections_are_deferred_and_young_ones_wait_for_the_working_set_of_requests():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        memory.tune_collections()
        assert gc.get_threshold() == (memory.YOUNG_THRESHOLD, 10, memory._NEVER)
        gc.set_threshold(50_000, 10, 10)
        memory.tune_collections()  # a higher young threshold set before is kept
        young, middle, full = gc.get_threshold()
        assert (young, middle) == (50_000, 10) and full >= 10**9
    finally:
        gc.set_threshold(*saved)


class Server:
    """A fake server for the housekeeper: busy or not, and a resident size that can grow."""

    def __init__(self) -> None:
        self.busy = False
        self.rss = 100 << 20
        self.runs: list[float] = []
        self.ran = threading.Event()

    def on_run(self, released: int, collect_s: float, trim_s: float) -> None:
        assert released >= 0 and collect_s >= 0 and trim_s >= 0
        self.runs.append(time.monotonic())
        self.ran.set()


def start_housekeeper(server: Server, busy_interval_s: float = 60.0) -> memory.Housekeeper:
    keeper = memory.Housekeeper(0.05, busy=lambda: server.busy, busy_interval_s=busy_interval_s,
                                on_run=server.on_run, resident=lambda: server.rss)
    saved = gc.get_threshold()
    assert keeper.start()
    gc.set_threshold(*saved)  # the test process keeps its own collections
    return keeper


def test_housekeeper_runs_once_after_start_up_then_only_after_work():
    server = Server()
    keeper = start_housekeeper(server)
    try:
        assert server.ran.wait(5)  # start-up's garbage
        time.sleep(0.4)
        assert len(server.runs) == 1  # quiet and nothing happened: no more runs
        server.busy = True
        time.sleep(0.3)
        assert len(server.runs) == 1  # never in the middle of work
        server.busy = False
        deadline = time.monotonic() + 5
        while len(server.runs) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server.runs) == 2  # quiet after work: one run
        server.rss += 50 << 20  # requests arriving, not yet admitted: resident memory grows
        time.sleep(0.03)
        runs_while_growing = len(server.runs)
        deadline = time.monotonic() + 5  # a loaded machine may run the housekeeping thread late
        while len(server.runs) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert runs_while_growing == 2 and len(server.runs) == 3  # the run waits for the growth to stop
    finally:
        keeper.stop()


def test_housekeeper_runs_under_unbroken_load_every_busy_interval():
    """Under unbroken load it still runs, and never sooner than the busy interval after the last run. The runs
    are timed from their starts (a full collection in a loaded test process can take a good part of a second,
    which would shift the ends), and waited for rather than counted in a fixed window, which a loaded machine
    cannot promise."""
    server = Server()
    server.busy = True
    starts: list[float] = []
    server.on_run = lambda released, collect_s, trim_s: starts.append(time.monotonic() - collect_s - trim_s)
    keeper = start_housekeeper(server, busy_interval_s=0.3)
    began = time.monotonic()
    try:
        deadline = began + 20
        while len(starts) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(starts) >= 3, f"{len(starts)} runs in 20 s under unbroken load"
        time.sleep(0.5)
    finally:
        keeper.stop()
    runs = list(starts)
    assert starts[0] - began >= 0.29  # the first run waits a busy interval too (start-up's run is not due at once)
    assert all(later - earlier >= 0.29 for earlier, later in zip(runs, runs[1:])), runs
    assert len(runs) <= (runs[-1] - began) / 0.3 + 1


def test_zero_interval_defers_nothing():
    saved = gc.get_threshold()
    assert memory.Housekeeper(0).start() is False
    assert gc.get_threshold() == saved
