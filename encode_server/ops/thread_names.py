"""The OS-level name of a thread: its Python name, where `top -H`, `ps -L`, py-spy, perf and `/proc/<pid>/task`
can see it (CPython before 3.14 leaves every thread named after the process).

`name_os_thread()` runs in the thread to name (the initializer of a pool, the first line of a thread's
target). Linux keeps 15 bytes of a name, so the end of a long one is cut (`encoder-processor_0` shows as
`encoder-process`). Elsewhere, or when the call fails, nothing happens: a name is never worth an error.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from encode_server.ops.libc import libc

_PR_SET_NAME = 15  # from linux/prctl.h
_NAME_BYTES = 15


def name_os_thread(name: str | None = None) -> bool:
    """Name the calling OS thread `name` (by default its Python thread's name); True when it took."""
    lib = libc() if sys.platform.startswith("linux") else None
    if lib is None:
        return False
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:_NAME_BYTES]
    return lib.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0
