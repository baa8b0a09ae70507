"""NIXL, as the producer uses it: one agent per server, one registered CPU pool that consumers read.

The pool is one anonymous mapping of `num_blocks` blocks of `block_size` bytes, registered with the
agent once at start-up: the agent's metadata and the per-block descriptors a consumer prepares its reads
with stay the same for the server's life, so a consumer registers this producer once (re-registering on
changed metadata would drop its reads in flight). The pool's size is the bound on registered memory: it
never grows, and an item that does not fit is refused (`RegistrationRefused`, answered 503 with
Retry-After) rather than pinning more.

Each item's rows are copied row-major into blocks of its own (its bytes padded to whole blocks), and the
item is kept as an entry:

- **writing**: blocks taken, bytes being copied (a read asked for now is told "not ready");
- **held**: written and not read yet, kept for `hold_s` so a burst of new items cannot evict it before its
  consumer reads it;
- **pinned**: granted to a consumer's read, until the consumer's notification or the read's lease ends;
- **cached**: read (or its hold lapsed) and not pinned; evicted oldest first when blocks are needed, and
  served again until then (a retried read, a second consumer).

`held_bytes` is what writing, held and pinned entries occupy: it returns to zero once every item has been
read or its hold lapsed. Reads themselves are the consumers' (one-sided NIXL READs); this side only learns
of them by the notifications `notifications` drains. The agent is not thread-safe: every call on it after
start-up (`notifications`, `close`) comes from one thread, the front's side-channel thread.

NIXL's own progress thread polls without pause (its Python API fixes the delay at 0): about 0.7 of a core
for an idle agent, measured on a 2-core VM. By default the agent runs without it, and the UCX worker
advances whenever `notifications` is called; over TCP a consumer's READ of this memory needs that progress
on this side, so the front calls it continuously (yielding the GIL between calls) while reads are granted, and every
20 ms otherwise (`progress_thread=True` gives NIXL's thread back, for hosts with cores to spare).
"""

from __future__ import annotations

import heapq
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from encode_server.ops.libraries import require
from encode_server.transport.registered import RegistrationRefused
from encode_server.transport.stats import TransportStats

log = logging.getLogger("encode_server.transport.nixl")


def quiet_ucx_exit() -> None:
    """Keep UCX's InfiniBand modules unloaded on a host without an RDMA device.

    The nixl wheels (1.5.1) bundle their own libibverbs and libnl-route; once UCX has loaded its `ib`
    modules, the process crashes in libnl-route's destructor at exit (SIGSEGV after a clean shutdown).
    Without an RDMA device those modules have nothing to drive, so they are left out; where one exists, or
    where `UCX_MODULES` is set already, nothing is changed. Must run before the first agent is made.
    """
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        os.environ["UCX_MODULES"] = "^ib*"


#: Linux's `MADV_POPULATE_WRITE` (5.14+); Python names it from 3.13 only.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def prefault(area: mmap.mmap) -> None:
    """Fault every page of `area` in now, as vLLM's producer does for its region: otherwise an item's first copy
    into fresh blocks pays a page fault per 4 KiB (0.7 ms of a 1 MiB put, ten times the copy itself)."""
    try:
        area.madvise(MADV_POPULATE_WRITE)
        return
    except (OSError, ValueError):  # an older kernel: touch one byte per page instead
        pass
    np.frombuffer(area, dtype=np.uint8)[::mmap.PAGESIZE] = 0


def block_descriptors(base: int, num_blocks: int, block_size: int) -> list[tuple[int, int, int]]:
    """One (address, length, device) per block, the form NIXL's `get_xfer_descs` takes."""
    return [(base + index * block_size, block_size, 0) for index in range(num_blocks)]


@dataclass
class PoolEntry:
    """One item in the pool: its blocks, the rows' shape and byte count, and its state."""

    block_ids: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    hold_until: float
    pins: int = 0
    reads: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    def evictable(self, now: float) -> bool:
        return self.ready.is_set() and self.pins == 0 and now >= self.hold_until


class NixlBlockPool:
    """A NIXL agent and its registered pool of blocks; see the module docstring. Thread-safe, except that the
    agent's own calls (`notifications`, `close`) belong to one thread."""

    def __init__(self, agent_name: str, block_size: int, pool_bytes: int, name: str = "ECCPUConnector",
                 progress_thread: bool = False) -> None:
        require("nixl", f"the {name} transport")
        if block_size <= 0:
            raise ValueError(f"{name}: the block size must be positive, got {block_size}")
        num_blocks = pool_bytes // block_size
        if num_blocks < 1:
            raise ValueError(f"{name}: ec_cpu_bytes ({pool_bytes}) holds no block of {block_size} bytes: raise it")
        quiet_ucx_exit()
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.agent_name = agent_name
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.registered_bytes = num_blocks * block_size
        self._map = mmap.mmap(-1, self.registered_bytes)
        prefault(self._map)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._tensor = torch.from_numpy(self._bytes)
        self.base = self._bytes.ctypes.data
        self.agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
        self._registration = self.agent.get_reg_descs([(self.base, self.registered_bytes, 0, "")], "DRAM")
        self.agent.register_memory(self._registration, backends=["UCX"])
        descriptors = block_descriptors(self.base, num_blocks, block_size)
        self.agent_metadata: bytes = self.agent.get_agent_metadata()
        self.mem_descriptor: bytes = msgpack.packb(descriptors)
        self.stats = TransportStats(name)
        self._lock = threading.Lock()
        self._free: list[int] = list(range(num_blocks))  # a heap: the lowest blocks first, so items stay contiguous
        self._entries: OrderedDict[str, PoolEntry] = OrderedDict()  # oldest first, for eviction
        self._closed = False
        log.info("NIXL agent %s: %d blocks of %d bytes registered (%d bytes)", agent_name, num_blocks, block_size,
                 self.registered_bytes)

    # --- the items ----------------------------------------------------------------------------------

    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_size))

    def put(self, key: str, rows: torch.Tensor, hold_s: float) -> PoolEntry:
        """Copy `rows` into blocks of their own under `key` (an item there already is kept and held again);
        `RegistrationRefused` when no blocks can be freed for them."""
        rows = rows.detach().to("cpu").contiguous()
        flat = rows.view(-1).view(torch.uint8) if rows.numel() else torch.zeros(0, dtype=torch.uint8)
        nbytes = int(flat.numel())
        blocks = self.blocks_for(nbytes)
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the transport is closed")
            entry = self._entries.get(key)
            if entry is not None:
                if entry.nbytes != nbytes or tuple(entry.shape) != tuple(rows.shape):
                    raise RuntimeError(f"{self.name}: item {key} is in the pool with other rows "
                                       f"({list(entry.shape)}, now {list(rows.shape)})")
                entry.hold_until = max(entry.hold_until, now + hold_s)
                fresh = False
            else:
                if blocks > self.num_blocks:
                    self.stats.refuse()
                    raise RegistrationRefused(
                        f"{nbytes} bytes of rows are more than the whole registered pool ({self.registered_bytes} "
                        f"bytes): raise ec_cpu_bytes", retry_after_s=5)
                self._evict_for(blocks, now)
                if len(self._free) < blocks:
                    self.stats.refuse()
                    held = sum(len(e.block_ids) for e in self._entries.values()) * self.block_size
                    raise RegistrationRefused(
                        f"the registered pool is full ({held} of {self.registered_bytes} bytes held by items not "
                        f"read yet or being read; {nbytes} more asked for): try again shortly",
                        retry_after_s=self._retry_after(now))
                ids = tuple(sorted(heapq.heappop(self._free) for _ in range(blocks)))
                entry = PoolEntry(ids, tuple(rows.shape), nbytes, now + hold_s)
                self._entries[key] = entry
                fresh = True
        if not fresh:
            if not entry.ready.wait(timeout=60):
                raise RuntimeError(f"{self.name}: item {key} was not written within 60 s")
            return entry
        try:
            self._copy_in(entry, flat)
        except BaseException:
            with self._lock:
                self._drop(key)
            raise
        entry.ready.set()
        return entry

    def _copy_in(self, entry: PoolEntry, flat: torch.Tensor) -> None:
        """Row-major bytes into the entry's blocks, run by run; the last block's tail zeroed."""
        done, size = 0, self.block_size
        ids = entry.block_ids
        start = 0
        while start < len(ids):
            end = start + 1
            while end < len(ids) and ids[end] == ids[end - 1] + 1:
                end += 1
            offset = ids[start] * size
            length = (end - start) * size
            take = min(length, flat.numel() - done)
            if take > 0:  # numpy's copy: torch's `copy_` here made a 1 MiB put+read about 8x slower, end to end
                self._bytes[offset:offset + take] = flat[done:done + take].numpy()
            if take < length:
                self._tensor[offset + max(take, 0):offset + length].zero_()
            done += max(take, 0)
            start = end

    def _evict_for(self, blocks: int, now: float) -> None:
        """Evict cached entries, oldest first, until `blocks` are free (or none is left to evict). Lock held."""
        if len(self._free) >= blocks:
            return
        for key in [key for key, entry in self._entries.items() if entry.evictable(now)]:
            self._drop(key)
            if len(self._free) >= blocks:
                return

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            for block in entry.block_ids:
                heapq.heappush(self._free, block)

    def _retry_after(self, now: float) -> int:
        """Seconds until the soonest hold lapses (at least 1, at most 30)."""
        holds = [entry.hold_until - now for entry in self._entries.values()
                 if entry.pins == 0 and entry.hold_until > now]
        return max(1, min(30, int(min(holds, default=1.0) + 0.999)))

    def pin(self, key: str) -> PoolEntry | None | bool:
        """Pin the item for a read: its entry; None when the pool lacks it; False while it is being written."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if not entry.ready.is_set():
                return False
            entry.pins += 1
            return entry

    def unpin(self, key: str, read: bool) -> None:
        """A pin ends: the read completed (`read`: the item needs no hold any more) or its lease lapsed."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.pins <= 0:
                return
            entry.pins -= 1
            if read:
                entry.reads += 1
                entry.hold_until = 0.0

    def entry(self, key: str) -> PoolEntry | None:
        with self._lock:
            return self._entries.get(key)

    # --- what it holds ------------------------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        """Bytes of blocks that cannot be evicted now: items being written, not read yet, or being read."""
        now = time.monotonic()
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values() if not e.evictable(now)) * self.block_size

    @property
    def stored_bytes(self) -> int:
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values()) * self.block_size

    @property
    def pins(self) -> int:
        with self._lock:
            return sum(entry.pins for entry in self._entries.values())

    @property
    def items(self) -> int:
        with self._lock:
            return len(self._entries)

    # --- the agent (one thread) ---------------------------------------------------------------------

    def notifications(self) -> dict[str, list[bytes]]:
        """The consumers' notifications since the last call, by agent name."""
        return self.agent.get_new_notifs()

    def close(self) -> None:
        """Deregister the pool; the mapping goes with the object."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
        try:
            self.agent.deregister_memory(self._registration, backends=["UCX"])
        except Exception:  # noqa: BLE001 - closing goes on whatever the library says
            log.warning("NIXL: deregistering the pool failed", exc_info=True)
