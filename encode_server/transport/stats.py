"""What one transport has moved: bytes, transfers, failures, seconds, and what it holds now.

Updated by the transport's front from worker threads (a lock keeps the counters whole) and read by
`/metrics` at every scrape (`ops.metrics.TransportCollector`) and by `/server_info`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class TransportStats:
    """Counters of one transport (`name`: the peer connector it speaks, such as `ECMooncakeConnector`)."""

    name: str
    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    seconds: float = 0.0
    refused: int = 0  # items answered 503 because the registered-memory bound was reached
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def transferred(self, nbytes: int, seconds: float, count: int = 1) -> None:
        with self._lock:
            self.bytes += nbytes
            self.transfers += count
            self.seconds += seconds

    def failed(self, count: int = 1) -> None:
        with self._lock:
            self.failures += count

    def refuse(self, count: int = 1) -> None:
        with self._lock:
            self.refused += count

    def as_json(self) -> dict[str, float | int | str]:
        with self._lock:
            return {"name": self.name, "bytes": self.bytes, "transfers": self.transfers,
                    "failures": self.failures, "seconds": round(self.seconds, 6), "refused": self.refused}
