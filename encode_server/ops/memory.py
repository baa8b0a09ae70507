"""Byte sizes and memory: read `512MiB`-style sizes, find how much memory this process may use, and
the embedding cache's default capacity.

No heavy imports here: the settings module uses it, and `--help` must answer fast.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

GIB = 1 << 30

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")

#: `--cache-bytes auto`: this share of the memory the process may use, and never more than `AUTO_CACHE_MAX`.
AUTO_CACHE_SHARE = 0.05
AUTO_CACHE_MAX = GIB


def parse_byte_size(text: str | int) -> int:
    """`1048576`, `512MiB`, `1.5GB`, `64k` as a number of bytes (decimal units are powers of 1000)."""
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"expected a size in bytes such as 1073741824, 512MiB or 2GB (units: k, M, G, T or "
                         f"KB, MB, GB, TB, powers of 1000; KiB, MiB, GiB, TiB, powers of 1024), got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_cache_bytes(text: str | int) -> int | str:
    """`auto` (see `default_cache_bytes`) or a byte size; 0 turns the cache off."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise ValueError(f"expected 'auto', 0 (no cache) or {str(exc).removeprefix('expected ')}") from None


def _cgroup_limit() -> int | None:
    """The container's memory limit (cgroup v2 or v1), when there is one."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # "max" or a huge number mean no limit
            return int(text)
    return None


def available_memory_bytes() -> int:
    """The memory this process may use: the machine's RAM, or the container's limit when lower."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 8 * GIB  # an unknown platform: assume a small machine
    limit = _cgroup_limit()
    return min(physical, limit) if limit else physical


def default_cache_bytes(memory: int | None = None) -> int:
    """`--cache-bytes auto`: 5% of the available memory, at most 1 GiB."""
    memory = available_memory_bytes() if memory is None else memory
    return int(min(AUTO_CACHE_MAX, memory * AUTO_CACHE_SHARE))


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident set size (Linux `/proc`), or None where that cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_seconds(pid: int | str = "self", tid: int | str | None = None) -> float | None:
    """A process's user plus system CPU time so far, or with `tid` one of its threads' (Linux `/proc`); None
    where that cannot be read (or the thread has ended)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
