"""Tensors handed from one process to another through POSIX shared memory, never through pickle.

The writer copies an item's CPU tensors into shared memory (files in /dev/shm, each tensor aligned to a
cache line) and sends only `SharedTensors` (the file's name, dtypes, shapes and offsets). The reader
maps the file, unlinks its name at once, and gets tensors that are views of the mapping.

Two kinds of file:
- a one-off block (`export_tensors` / `import_tensors`): written once, freed when the last view is;
- a reusable slot (`SlotWriter` / `SlotReader`): a worker keeps a few slots mapped, the reader maps
  each once, and the writer reuses a slot once the reader released it. A fresh block costs a page
  allocation per 4 KiB on both sides; a reused slot costs one memory copy, and none when the processor
  wrote its output straight into the slot (`SlotWriter.reserve`).
"""

from __future__ import annotations

import itertools
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
    slot: int | None = None  # the writer's reusable slot it lies in; None: a one-off block


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list, int]:
    """Contiguous tensors, their `(key, dtype, shape, offset)` entries, and the bytes they need."""
    entries, offset = [], 0
    tensors = {key: value.detach().contiguous() for key, value in tensors.items()}
    for key, value in tensors.items():
        entries.append((key, str(value.dtype).removeprefix("torch."), tuple(value.shape), offset))
        offset += -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
    return tensors, entries, offset


def export_tensors(tensors: dict[str, torch.Tensor], path: Path) -> SharedTensors:
    """Copy CPU tensors into a new shared-memory block at `path` (the receiver unlinks it)."""
    tensors, entries, offset = _layout(tensors)
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
    return _views(_map_and_unlink(shared.path, shared.size), shared)


def _map_and_unlink(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:  # MAP_POPULATE: the pages are mapped in one call, not faulted in one by one by the reader
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
        os.unlink(path)


def _views(block: mmap.mmap, shared: SharedTensors) -> dict[str, torch.Tensor]:
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


@dataclass
class _Slot:
    id: int
    path: str
    capacity: int
    mapping: mmap.mmap
    busy: bool = False


def _in_place_or_outside(slot: _Slot, entries: list, tensors) -> bool:
    """Whether each tensor either lies exactly where `write` puts it in `slot` or outside the slot (a tensor
    overlapping it elsewhere, say a slice of what a processor wrote there, would be overwritten while read)."""
    base = torch.frombuffer(slot.mapping, dtype=torch.uint8, count=1).data_ptr()
    for (_, _, _, start), value in zip(entries, tensors):
        address = value.data_ptr()
        if value.numel() and base <= address < base + slot.capacity and address != base + start:
            return False
    return True


class SlotWriter:
    """A worker's reusable shared-memory slots (see the module docstring).

    `write` copies an item's tensors into a free slot big enough for them, making one (or replacing a
    free one that is too small) within `max_slots` and `max_bytes`; it returns None when none can be
    had, and the caller sends a one-off block instead. A slot stays busy until `release`d: the reader
    says so (through the pool) once nothing reads the tensors any more. New slots get a new name, so a
    reader never confuses a replaced slot with its predecessor.
    """

    def __init__(self, prefix: str, max_slots: int = 8, max_bytes: int = 512 << 20) -> None:
        self.prefix = prefix
        self.max_slots = max_slots
        self.max_bytes = max_bytes
        self._slots: dict[int, _Slot] = {}
        self._names = itertools.count()
        self._reserved: _Slot | None = None
        self.bytes_copied = 0  # what `write` had to copy (not what a processor wrote into a reserved slot)

    def reserve(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 view of the first `nbytes` of a free slot (with room for a few small tensors after them),
        for a processor to write an item's first tensor into; the next `write` uses that slot and copies
        nothing for a tensor already in place. None when no slot can be had (allocate as usual then)."""
        size = -(-nbytes // _ALIGN) * _ALIGN + 16 * _ALIGN
        free = [slot for slot in self._slots.values() if not slot.busy and slot.capacity >= size]
        slot = min(free, key=lambda candidate: candidate.capacity) if free else self._new_slot(size)
        self._reserved = slot
        return None if slot is None else torch.frombuffer(slot.mapping, dtype=torch.uint8, count=nbytes)

    def release(self, slot_ids) -> None:
        for slot_id in slot_ids:
            if slot_id in self._slots:
                self._slots[slot_id].busy = False

    def write(self, tensors: dict[str, torch.Tensor]) -> SharedTensors | None:
        tensors, entries, size = _layout(tensors)
        if size == 0:
            return None
        reserved, self._reserved = self._reserved, None
        if reserved is not None and reserved.id in self._slots and not reserved.busy and reserved.capacity >= size \
                and _in_place_or_outside(reserved, entries, tensors.values()):
            slot = reserved
        else:
            free = [slot for slot in self._slots.values() if not slot.busy and slot.capacity >= size
                    and slot is not reserved]
            slot = min(free, key=lambda candidate: candidate.capacity) if free else self._new_slot(size)
        if slot is None:
            return None
        for (_, _, _, start), value in zip(entries, tensors.values()):
            if value.numel():
                nbytes = value.numel() * value.element_size()
                destination = torch.frombuffer(slot.mapping, dtype=torch.uint8, count=nbytes, offset=start)
                if destination.data_ptr() != value.data_ptr():  # else: written in place (`reserve`)
                    destination.copy_(value.reshape(-1).view(torch.uint8))
                    self.bytes_copied += nbytes
                del destination  # no buffer export left on the mapping, so that it can be closed later
        slot.busy = True
        return SharedTensors(slot.path, slot.capacity, tuple(entries), slot.id)

    def _new_slot(self, size: int) -> _Slot | None:
        capacity = -(-size * 5 // 4 // (1 << 20)) * (1 << 20)  # 25% headroom for the next, larger item
        # Make room by dropping free slots (too small for this item), smallest first.
        for victim in sorted((s for s in self._slots.values() if not s.busy), key=lambda s: s.capacity):
            if len(self._slots) < self.max_slots and self.held_bytes() + capacity <= self.max_bytes:
                break
            self._drop(victim)
        if len(self._slots) >= self.max_slots or self.held_bytes() + capacity > self.max_bytes:
            return None
        slot_id = next(index for index in itertools.count() if index not in self._slots)
        path = f"{self.prefix}-slot{next(self._names)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, capacity)  # a full tmpfs says ENOSPC here, not SIGBUS at a write
            mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        self._slots[slot_id] = slot = _Slot(slot_id, path, capacity, mapping)
        return slot

    def _drop(self, slot: _Slot) -> None:
        del self._slots[slot.id]
        try:
            slot.mapping.close()
        except BufferError:  # a view still exported: the mapping goes with it
            pass
        try:
            os.unlink(slot.path)  # normally the reader has already
        except FileNotFoundError:
            pass

    def held_bytes(self) -> int:
        return sum(slot.capacity for slot in self._slots.values())

    def close(self) -> None:
        for slot in list(self._slots.values()):
            self._drop(slot)


class SlotReader:
    """The reading side of one writer's slots: each slot's file is mapped once (and unlinked), then
    every item written into it is read as views of that mapping."""

    def __init__(self) -> None:
        self._mappings: dict[int, tuple[str, mmap.mmap]] = {}

    def read(self, shared: SharedTensors) -> dict[str, torch.Tensor]:
        known = self._mappings.get(shared.slot)
        if known is None or known[0] != shared.path:
            known = self._mappings[shared.slot] = (shared.path, _map_and_unlink(shared.path, shared.size))
        return _views(known[1], shared)


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
