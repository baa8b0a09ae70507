"""`ops.thread_names`: a thread's Python name becomes its OS-level name (what /proc, top -H and py-spy show)."""

from __future__ import annotations

import sys
import threading

import pytest

from encode_server.ops.thread_names import name_os_thread

pytestmark = [pytest.mark.quick, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's prctl")]


def os_name_of(thread: threading.Thread) -> str:
    with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
        return comm.read().strip()


def test_a_thread_takes_its_python_name_cut_to_linux_fifteen_bytes():
    seen: dict[str, bool] = {}
    named, release = threading.Event(), threading.Event()

    def body() -> None:
        seen["took"] = name_os_thread()
        named.set()
        release.wait(5)

    thread = threading.Thread(target=body, name="encoder-processor_7")
    thread.start()
    try:
        assert named.wait(5)
        assert seen["took"] is True and os_name_of(thread) == "encoder-process"
    finally:
        release.set()
        thread.join()


def test_the_server_threads_that_do_the_work_are_named():
    from encode_server.media.priority_pool import PriorityThreadPool

    pool = PriorityThreadPool(1, thread_name_prefix="media-decode")
    try:
        pool.submit(lambda: None).result(5)
        (worker,) = pool._threads
        assert os_name_of(worker) == "media-decode_0"
    finally:
        pool.shutdown()
