"""Mooncake's TransferEngine, as the producer uses it: one engine per server, writes into peers' memory.

The engine is started with `P2PHANDSHAKE` metadata (no metadata server: a peer is named by its
`host:rpc_port` session, which it hands out with each reservation) over `protocol` (`rdma` where an
RDMA NIC is, `tcp` anywhere). Sources are registered only while they are written (`RegisteredMemory`,
within its bound); `write` is one synchronous batch to one peer session and raises on any failure, a
vanished peer included (its connect fails), so only that peer's items fail.
"""

from __future__ import annotations

import logging
import threading
import time

from encode_server.ops.libraries import require
from encode_server.transport.registered import RegisteredMemory
from encode_server.transport.stats import TransportStats

log = logging.getLogger("encode_server.transport.mooncake")


class MooncakeEngine:
    """A started TransferEngine and the memory registered with it; thread-safe."""

    def __init__(self, hostname: str, protocol: str, limit_bytes: int, name: str = "mooncake",
                 device_name: str = "") -> None:
        require("mooncake", f"the {name} transport")
        from mooncake.engine import TransferEngine

        self.hostname = hostname
        self.protocol = protocol
        self.engine = TransferEngine()
        status = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if status != 0:
            hint = " (mooncake_protocol 'tcp' works without an RDMA NIC)" if protocol != "tcp" else ""
            raise RuntimeError(f"Mooncake's TransferEngine did not start on {hostname} over {protocol} "
                               f"(status {status}){hint}")
        self.stats = TransportStats(name)
        self.memory = RegisteredMemory(limit_bytes, self._register, self._unregister,
                                       what=f"{name} registered memory")
        self._closed = threading.Event()
        log.info("Mooncake TransferEngine ready at %s over %s (registered memory bound %s bytes)",
                 self.session, protocol, limit_bytes or "no")

    @property
    def session(self) -> str:
        """This engine's session name, as peers would write to it."""
        return f"{self.hostname}:{self.engine.get_rpc_port()}"

    def _register(self, addresses: list[int], lengths: list[int]) -> None:
        status = self.engine.batch_register_memory(addresses, lengths)
        if status != 0:
            raise RuntimeError(f"Mooncake could not register {sum(lengths)} bytes (status {status})")

    def _unregister(self, addresses: list[int]) -> None:
        status = self.engine.batch_unregister_memory(addresses)
        if status != 0:
            log.error("Mooncake could not unregister %d regions (status %d)", len(addresses), status)

    def write(self, session: str, sources: list[int], destinations: list[int], lengths: list[int]) -> float:
        """Write each source range to its destination in the peer `session`; the seconds it took.
        The sources must be registered (`self.memory`)."""
        started = time.perf_counter()
        status = self.engine.batch_transfer_sync_write(session, sources, destinations, lengths)
        elapsed = time.perf_counter() - started
        if status != 0:
            self.stats.failed(len(sources))
            raise ConnectionError(f"Mooncake write of {sum(lengths)} bytes to {session} failed (status {status})")
        self.stats.transferred(sum(lengths), elapsed, len(sources))
        return elapsed

    def close(self) -> None:
        self._closed.set()
