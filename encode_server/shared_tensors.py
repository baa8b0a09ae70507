"""Tensors handed from one process to another through a POSIX shared-memory block, never through pickle.

The writer copies an item's CPU tensors into one block (a file in /dev/shm, each tensor aligned to a
cache line) and sends only `SharedTensors` (the block's name, dtypes, shapes and offsets). The reader
maps the block, unlinks its name at once, and gets tensors that are views of the mapping; the memory
is freed when the last view is.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

#: Where shared-memory blocks live: tmpfs on Linux (what `shm_open` uses), else the temp folder.
SHM_DIR = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
_ALIGN = 64  # each tensor of a block starts on a cache line


@dataclass(frozen=True)
class SharedTensors:
    """Where an item's tensors lie in one shared-memory block: `(key, dtype, shape, offset)` each."""

    path: str  # None-like "" when every tensor is empty (no block was made)
    size: int
    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]


def export_tensors(tensors: dict[str, torch.Tensor], path: Path) -> SharedTensors:
    """Copy CPU tensors into a new shared-memory block at `path` (the receiver unlinks it)."""
    entries, offset = [], 0
    tensors = {key: value.detach().contiguous() for key, value in tensors.items()}
    for key, value in tensors.items():
        entries.append((key, str(value.dtype).removeprefix("torch."), tuple(value.shape), offset))
        offset += -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
    if offset == 0:
        return SharedTensors("", 0, tuple(entries))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # pwrite, not a mapping: the kernel copies without a page fault per 4 KiB, and a full tmpfs says
        # ENOSPC here instead of SIGBUS at the first write to a mapped page.
        for (_, _, _, start), value in zip(entries, tensors.values()):
            if value.numel():
                data = value.reshape(-1).view(torch.uint8).numpy()
                written = os.pwrite(fd, data, start)
                while written < data.nbytes:
                    written += os.pwrite(fd, data[written:], start + written)
        os.ftruncate(fd, offset)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return SharedTensors(str(path), offset, tuple(entries))


def import_tensors(shared: SharedTensors) -> dict[str, torch.Tensor]:
    """Map a block written by `export_tensors`, unlink its name, and return views of it.

    The mapping stays alive as long as any returned tensor does (each view holds it), then is freed.
    """
    if not shared.path:
        return {key: torch.empty(shape, dtype=getattr(torch, dtype)) for key, dtype, shape, _ in shared.tensors}
    fd = os.open(shared.path, os.O_RDWR)
    try:  # MAP_POPULATE: the pages are mapped in one call, not faulted in one by one by the reader
        block = mmap.mmap(fd, shared.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(shared.path)
    tensors = {}
    for key, dtype, shape, offset in shared.tensors:
        torch_dtype = getattr(torch, dtype)
        count = 1
        for dim in shape:
            count *= dim
        if count == 0:
            tensors[key] = torch.empty(shape, dtype=torch_dtype)
        else:
            tensors[key] = torch.frombuffer(block, dtype=torch_dtype, count=count, offset=offset).view(shape)
    return tensors


def remove_stale_blocks() -> int:
    """Remove the blocks of pools whose server process is gone (killed before it could clean up)."""
    removed = 0
    for path in SHM_DIR.glob("encode-preprocess-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:  # another user's live process
            pass
    return removed
