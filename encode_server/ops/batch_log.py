"""The engine's log lines about batches: each batch at debug, a summary at info at most once a minute.

A line per batch at info was most of a busy server's log (hundreds a minute). Now each batch is one debug
line (`batch modality=image size=16 items=20 tokens=96 preprocess_ms=.. forward_ms=.. replica=0 batch=17`),
a health probe's batch marked `health-probe` so that it is not taken for traffic; and at info the first
batch of traffic, then at most one line every `SUMMARY_INTERVAL_S` while traffic goes on, sums up what
was encoded since the last one (health probes left out). No timer: the summary is written by the batch
that finds the interval over, so an idle server writes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("encode_server.engine")

#: Seconds between two info summaries of the batches, at least.
SUMMARY_INTERVAL_S = 60.0


class BatchLog:
    """Counts the batches of traffic and writes the lines of the module docstring. Called on one thread (the
    scheduler's)."""

    def __init__(self, interval_s: float = SUMMARY_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._since: float | None = None  # when the last summary was written (None: none yet)
        self._reset()

    def _reset(self) -> None:
        self.batches = self.requests = self.items = self.tokens = 0
        self.forward_s = self.forward_max_s = 0.0
        self.modalities: dict[str, int] = {}

    def batch(self, modality: str, batch_id: int, size: int, items: int, tokens: int, preprocess_s: float,
              forward_s: float, where: str, probe: bool = False) -> None:
        """One batch the engine encoded; `probe`: the health probe's own (never counted as traffic)."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("batch modality=%s size=%d items=%d tokens=%d preprocess_ms=%.1f forward_ms=%.1f %s batch=%d%s",
                      modality, size, items, tokens, preprocess_s * 1e3, forward_s * 1e3, where, batch_id,
                      " health-probe" if probe else "",
                      extra={"modality": modality, "batch_size": size, "items": items, "tokens": tokens,
                             "preprocess_ms": round(preprocess_s * 1e3, 1), "forward_ms": round(forward_s * 1e3, 1),
                             "batch_id": batch_id, "probe": probe})
        if probe:
            return
        self.batches += 1
        self.requests += size
        self.items += items
        self.tokens += tokens
        self.forward_s += forward_s
        self.forward_max_s = max(self.forward_max_s, forward_s)
        self.modalities[modality] = self.modalities.get(modality, 0) + 1
        now = self.clock()
        if self._since is not None and now - self._since < self.interval_s:
            return
        window = 0.0 if self._since is None else now - self._since
        by_modality = ", ".join(f"{name} {count}" for name, count in sorted(self.modalities.items()))
        log.info("encoded %d batches (%s) in the last %.0f s: %d requests, %d items, %d tokens, forward %.1f ms mean, "
                 "%.1f ms max", self.batches, by_modality, window, self.requests, self.items, self.tokens,
                 self.forward_s / self.batches * 1e3, self.forward_max_s * 1e3,
                 extra={"batches": self.batches, "requests": self.requests, "items": self.items,
                        "tokens": self.tokens, "window_s": round(window, 1),
                        "forward_ms_mean": round(self.forward_s / self.batches * 1e3, 1),
                        "forward_ms_max": round(self.forward_max_s * 1e3, 1)})
        self._since = now
        self._reset()
