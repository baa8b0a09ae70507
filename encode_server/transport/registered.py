"""Memory registered with a transfer library, within a bound.

A transfer library reads or writes only memory registered with it (with RDMA the NIC pins those pages);
this server registers each item's rows just for the time they are written and unregisters them after,
on success and on failure alike. `RegisteredMemory` counts the bytes registered at any moment and
refuses a registration that would go beyond its bound (`RegistrationRefused`, which the front answers
with 503 and Retry-After), so a burst of large items can never pin unbounded memory. The same region
asked for twice (one item named twice, rows shared through the embedding cache) is registered once and
counted once, until its last user lets go.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


class RegistrationRefused(RuntimeError):
    """Registering these bytes would go beyond the bound; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Region:
    nbytes: int
    users: int = 1


class RegisteredMemory:
    """Bytes registered with one library, never more than `limit_bytes` at once (0: no bound).

    `register(addresses, lengths)` and `unregister(addresses)` are the library's calls; they raise on
    failure. Thread-safe."""

    def __init__(self, limit_bytes: int, register: Callable[[list[int], list[int]], None],
                 unregister: Callable[[list[int]], None], what: str = "registered memory") -> None:
        self.limit_bytes = limit_bytes
        self._register = register
        self._unregister = unregister
        self._what = what
        self._lock = threading.Lock()
        self._regions: dict[int, _Region] = {}
        self._bytes = 0
        self.peak_bytes = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes

    @property
    def regions(self) -> int:
        return len(self._regions)

    def acquire(self, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """Register each (address, length) not registered yet; the addresses to `release` later."""
        unique: dict[int, int] = {}
        for address, nbytes in ranges:
            unique.setdefault(address, nbytes)
        with self._lock:
            new = [(address, nbytes) for address, nbytes in unique.items() if address not in self._regions]
            extra = sum(nbytes for _, nbytes in new)
            if self.limit_bytes and self._bytes + extra > self.limit_bytes:
                if extra > self.limit_bytes:
                    raise RegistrationRefused(
                        f"{extra} bytes of rows are more than the whole {self._what} bound ({self.limit_bytes} "
                        f"bytes): raise ec_buffer_size", retry_after_s=5)
                raise RegistrationRefused(
                    f"{self._what} is at its bound ({self._bytes} of {self.limit_bytes} bytes registered, "
                    f"{extra} more asked for): try again shortly")
            for address, region in self._regions.items():
                if address in unique and unique[address] != region.nbytes:
                    raise RuntimeError("a registered region changed its size while registered")
            if new:
                self._register([address for address, _ in new], [nbytes for _, nbytes in new])
            for address, nbytes in new:
                self._regions[address] = _Region(nbytes, users=0)
            for address in unique:
                self._regions[address].users += 1
            self._bytes += extra
            self.peak_bytes = max(self.peak_bytes, self._bytes)
        return list(unique)

    def release(self, addresses: Sequence[int]) -> None:
        """Let go of what `acquire` returned; regions nobody uses any more are unregistered."""
        with self._lock:
            unused = []
            for address in addresses:
                region = self._regions.get(address)
                if region is None:
                    continue
                region.users -= 1
                if region.users <= 0:
                    unused.append(address)
            for address in unused:
                self._bytes -= self._regions.pop(address).nbytes
            if unused:
                self._unregister(unused)

    @contextmanager
    def pinned(self, ranges: Sequence[tuple[int, int]]) -> Iterator[list[int]]:
        """`acquire` for the time of a `with` block, released however it ends."""
        addresses = self.acquire(ranges)
        try:
            yield addresses
        finally:
            self.release(addresses)
