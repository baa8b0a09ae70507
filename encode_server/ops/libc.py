"""The C library this process runs on, for the few calls Python does not wrap (`prctl`, `mallopt`,
`malloc_trim`): loaded once, from the symbols already in the process (no search of the system's libraries).
None where there is none to load (not a POSIX system)."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def libc() -> ctypes.CDLL | None:
    if os.name != "posix":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
