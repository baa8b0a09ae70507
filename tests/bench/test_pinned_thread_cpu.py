"""`benchmarks/pinned.py --thread-cpu`: CPU per request by thread, read from /proc for a live process (this one)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from benchmarks.pinned import per_request_ms, thread_cpu_s
from encode_server.ops.thread_names import name_os_thread

pytestmark = [pytest.mark.quick, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")]


def test_a_busy_named_thread_shows_its_cpu_per_request_under_its_name():
    before = thread_cpu_s(os.getpid())
    burnt, release = threading.Event(), threading.Event()

    def burn() -> None:
        name_os_thread()
        started = time.thread_time()
        while time.thread_time() - started < 0.2:
            pass
        burnt.set()
        release.wait(10)  # alive while it is read: a thread that has ended is gone from /proc

    worker = threading.Thread(target=burn, name="bench-burner")
    worker.start()
    try:
        assert burnt.wait(30)
        after = thread_cpu_s(os.getpid())
    finally:
        release.set()
        worker.join()
    assert "MainThread" in before and "bench-burner" not in before
    spent = per_request_ms(before, after, requests=2)
    assert 100 - 10 <= spent["bench-burner"] <= 150  # 0.2 s over 2 requests, in ms, give or take a clock tick
    assert list(spent) == sorted(spent, key=lambda name: -spent[name])  # busiest first
