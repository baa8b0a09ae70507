"""Runs batches off the event loop, in two overlapped stages.

Stage one (one thread) calls the processor once for all items of a batch; stage two (another
thread) runs the encoder forward. While batch N is in the forward, batch N+1 is being preprocessed,
so the device does not wait for the CPU. After the forward, the rows are sliced per item by the
model's own grid and handed back per request as contiguous views of one tensor.

A batch that fails as a whole is retried one request at a time, so a request the processor or
model chokes on fails alone and never its neighbours.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from processors import EncoderAdapter

from .jobs import EncodeError, EncodeJob, EncodeOutcome
from .metrics import ServerMetrics

log = logging.getLogger("encode_server.engine")
T = TypeVar("T")


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """Run `fn` and measure it where it runs (in its worker thread, not while queued for it)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


class EncoderEngine:
    """Encodes batches of jobs with one processor call and one forward each."""

    def __init__(self, adapter: EncoderAdapter, metrics: ServerMetrics) -> None:
        self.adapter = adapter
        self.metrics = metrics
        self._preprocess_pool = ThreadPoolExecutor(1, thread_name_prefix="encoder-preprocess")
        self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="encoder-forward")
        self.replicas = None  # parallel.ranks.DataParallelReplicas when --dp-size > 1

    def close(self) -> None:
        self._preprocess_pool.shutdown(wait=False, cancel_futures=True)
        self._forward_pool.shutdown(wait=False, cancel_futures=True)

    async def encode(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodeOutcome | EncodeError]:
        """One outcome per job, in order. Never raises: failures come back as `EncodeError`s."""
        try:
            return list(await self._encode_fused(modality, jobs))
        except Exception as exc:
            if len(jobs) == 1:
                log.exception("encoding %s request %s failed", modality, jobs[0].req_id)
                return [EncodeError(500, f"encoder failed: {exc}", jobs[0].req_id)]
            log.warning("fused %s batch of %d failed (%s); retrying one at a time", modality, len(jobs), exc)
        outcomes: list[EncodeOutcome | EncodeError] = []
        for job in jobs:
            outcomes.extend(await self.encode(modality, [job]))
        return outcomes

    async def _encode_fused(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodeOutcome]:
        if self.replicas is None:
            return await self._encode_here(modality, jobs)
        replica = self.replicas.pick()
        self.replicas.in_flight[replica] += 1
        try:
            if replica == 0:
                return await self._encode_here(modality, jobs)
            rows, layouts, elapsed = await self.replicas.run_remote(replica, modality, jobs)
            self._check_layouts(jobs, layouts, rows)
            return self._outcomes(modality, jobs, rows, 0.0, elapsed, f"replica={replica}")
        finally:
            self.replicas.in_flight[replica] -= 1

    async def _encode_here(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodeOutcome]:
        loop = asyncio.get_running_loop()
        self.adapter.before_batch(modality, jobs)
        items = [item for job in jobs for item in job.items]
        prepared, preprocess_s = await loop.run_in_executor(
            self._preprocess_pool, _timed, self.adapter.preprocess, modality, items)
        # The forward runs even for a batch that does not look right, so that tensor-parallel ranks
        # reach their layout agreement together; the checks come after it.
        rows, forward_s = await loop.run_in_executor(self._forward_pool, _timed, self.adapter.forward, prepared)
        self.adapter.split_rows(prepared, rows)  # checks the row count against the grids
        self._check_layouts(jobs, prepared.layouts, rows)
        self.metrics.preprocess.labels(modality, "processor").observe(preprocess_s)
        return self._outcomes(modality, jobs, rows, preprocess_s, forward_s, "replica=0")

    @staticmethod
    def _check_layouts(jobs: Sequence[EncodeJob], layouts: list, rows: torch.Tensor) -> None:
        expected = [layout for job in jobs for layout in job.layouts]
        if list(layouts) != expected:
            raise RuntimeError(f"processor grids {layouts} differ from the admitted layouts {expected}")
        if rows.shape[0] != sum(layout.tokens for layout in expected):
            raise RuntimeError(f"forward produced {rows.shape[0]} rows for {sum(j.tokens for j in jobs)} tokens")

    def _outcomes(self, modality: str, jobs: Sequence[EncodeJob], rows: torch.Tensor, preprocess_s: float,
                  forward_s: float, where: str) -> list[EncodeOutcome]:
        tokens = rows.shape[0]
        self.metrics.forward.labels(modality).observe(forward_s)
        self.metrics.batch_tokens.labels(modality).observe(tokens)
        log.info("batch modality=%s size=%d items=%d tokens=%d preprocess_ms=%.1f forward_ms=%.1f %s",
                 modality, len(jobs), sum(len(job.items) for job in jobs), tokens, preprocess_s * 1e3,
                 forward_s * 1e3, where)
        outcomes, start = [], 0
        for job in jobs:
            end = start + job.tokens
            embedding: torch.Tensor = rows[start:end]
            outcomes.append(EncodeOutcome(
                embedding=embedding, layouts=job.layouts, batch_size=len(jobs),
                timings_ms={"preprocess": (job.preprocess_s + preprocess_s) * 1e3, "encode": forward_s * 1e3},
            ))
            start = end
        return outcomes
