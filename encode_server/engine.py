"""Runs batches off the event loop, in two overlapped stages.

Stage one (the processor's thread) calls the model's processor once for all items of a batch; stage
two (the forward's thread) runs the encoder forward. While batch N is in the forward, batch N+1 is in
the processor, so the device does not wait for the CPU. The processor's thread queues its batch for the forward
itself, so the next forward never waits for the event loop's turn. Where the scheduler's overlap is adaptive
(a CPU server: `scheduling.overlap`) and the processor takes two callers at once (`Processor.concurrent_calls`),
the processor has two threads, so when preparing is the longer stage the two batches in flight prepare side by
side, each going to the forward when it is ready. After the forward, the adapter
slices the rows once, per request, by the model's own grid (checked against the forward's row
count), and each job gets an `EncodedPart` holding its view of the batch's rows.

A batch that fails as a whole is retried one request at a time, so a request the processor or
model chokes on fails alone and never its neighbours.

With a `PreprocessPool` (`--preprocess-workers`), stage one is the pool instead: the batch's items
(their raw bytes) are decoded and put through the processor one per worker process, in parallel, and `collate`d
in order in the forward's thread just before the forward. An item a worker cannot prepare fails its
own request (400 from the decoder or processor, 500 when its worker died twice on it); the other
requests of the batch go on without it.

With a pool the scheduler may also `prefetch` a queued job: its items go to the pool as spare work
(taken only by idle workers) while earlier batches are in the forward, and the batch that later holds
the job uses those results instead of preparing the items again (the scheduler dispatches a job
prepared ahead once `prepared_ahead` says so). So the workers keep busy whenever requests wait.
`forget_prefetch` gives the results back for a job that leaves the queue without being encoded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from encode_server.models import EncoderAdapter, ItemLayout, PreparedBatch
from encode_server.ops.batch_log import BatchLog
from encode_server.ops.metrics import ServerMetrics
from encode_server.ops.thread_names import name_os_thread
from encode_server.records import BatchInfo, EncodedPart, EncodeError, EncodeJob, Timings

if TYPE_CHECKING:
    from encode_server.preprocessing.pool import PreprocessPool

log = logging.getLogger("encode_server.engine")
T = TypeVar("T")


def _settle(future: concurrent.futures.Future, result: Any = None, exception: BaseException | None = None) -> None:
    """End `future`, unless its awaiter cancelled it meanwhile."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)


def _locations(job: EncodeJob) -> list[str]:
    """How the pool names a job's items in its errors: their place in the request."""
    return [f"mm_items[{index}]" for index in range(len(job.raw_items))]


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """Run `fn` and measure it where it runs (in its worker thread, not while queued for it)."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _timed_with_cpu(fn: Callable[..., T], *args: Any) -> tuple[T, float, float]:
    """`_timed`, and the CPU seconds of the thread that ran it (which threads contending for the cores do not
    inflate, where they stretch the wall time)."""
    cpu = time.thread_time()
    result, wall = _timed(fn, *args)
    return result, wall, time.thread_time() - cpu


class EncoderEngine:
    """Encodes batches of jobs with one processor call and one forward each.

    `replicas` (a `parallel.ranks.DataParallelReplicas`, with `--dp-size` above 1) spreads the
    batches over whole copies of the encoder; without it every batch runs here."""

    def __init__(self, adapter: EncoderAdapter, metrics: ServerMetrics, replicas: Any = None,
                 preprocess_pool: PreprocessPool | None = None, processor_threads: int = 1) -> None:
        self.adapter = adapter
        self.metrics = metrics
        self.replicas = replicas
        self.preprocess_pool = preprocess_pool  # worker processes, or None: the processor runs in a thread here
        # id(job) -> (job, its pool submission): the job is kept so its id cannot be reused while listed
        self._prefetched: dict[int, tuple[EncodeJob, concurrent.futures.Future]] = {}
        # With two, two batches in flight may both be in the processor at once (where preparing is the longer
        # stage: camera images on a CPU); each goes to the forward when it is ready.
        self.processor_threads = processor_threads
        self._processor_thread = ThreadPoolExecutor(processor_threads, thread_name_prefix="encoder-processor",
                                                    initializer=name_os_thread)
        self._forward_pool = ThreadPoolExecutor(1, thread_name_prefix="encoder-forward", initializer=name_os_thread)
        self._batch_ids = itertools.count(1)  # each batch's id, in its log line and its trace
        self.batch_log = BatchLog()

    @property
    def can_prefetch(self) -> bool:
        """Whether `prefetch` does anything: a pool prepares items here (not on data-parallel replicas)."""
        return self.preprocess_pool is not None and self.replicas is None

    def prefetch(self, job: EncodeJob, on_done: Callable[[], None] | None = None) -> bool:
        """Start preparing a queued job's items in the pool as spare work; whether it was started.
        `on_done()` runs (in the pool's thread) when they are ready. Call it on the scheduler's loop, and
        `forget_prefetch` if the job leaves the queue without `encode`."""
        if not self.can_prefetch or not self._poolable(job) or id(job) in self._prefetched:
            return False
        future = self.preprocess_pool.submit(job.modality, job.raw_items, _locations(job), spare=True)
        self._prefetched[id(job)] = (job, future)
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        return True

    def prepared_ahead(self, job: EncodeJob) -> bool:
        """Whether what `prefetch` started for `job` is done (its items are ready, or failed)."""
        entry = self._prefetched.get(id(job))
        return entry is not None and entry[1].done()

    def forget_prefetch(self, job: EncodeJob) -> None:
        """Drop what `prefetch` started for `job`: items not started are skipped, those done given back."""
        entry = self._prefetched.pop(id(job), None)
        if entry is not None:
            self.preprocess_pool.discard(entry[1])

    def close(self) -> None:
        self._processor_thread.shutdown(wait=False, cancel_futures=True)
        self._forward_pool.shutdown(wait=False, cancel_futures=True)

    async def encode(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodedPart | EncodeError]:
        """One result per job, in order. Never raises: failures come back as `EncodeError`s."""
        try:
            return list(await self._encode_fused(modality, jobs))
        except Exception as exc:
            if len(jobs) == 1:
                log.exception("encoding %s request %s failed", modality, jobs[0].req_id)
                return [EncodeError(500, f"encoder failed: {exc}", jobs[0].req_id)]
            log.warning("fused %s batch of %d failed (%s); retrying one at a time", modality, len(jobs), exc)
        results: list[EncodedPart | EncodeError] = []
        for job in jobs:
            results.extend(await self.encode(modality, [job]))
        return results

    async def _encode_fused(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodedPart | EncodeError]:
        dispatched = time.perf_counter()
        if self.replicas is None:
            return await self._encode_here(modality, jobs, dispatched)
        with self.replicas.lease() as replica:
            if replica == 0:
                return await self._encode_here(modality, jobs, dispatched)
            rows, layouts, elapsed = await self.replicas.run_remote(replica, modality, jobs)
            ended = time.perf_counter()  # the replica prepares and forwards the batch: one span for both
            return self._parts(modality, jobs, layouts, rows, 0.0, elapsed, f"replica={replica}",
                               (dispatched, ended - elapsed, ended - elapsed, ended - elapsed, ended))

    @staticmethod
    def _poolable(job: EncodeJob) -> bool:
        return len(job.raw_items) == len(job.layouts)

    async def _encode_here(self, modality: str, jobs: Sequence[EncodeJob],
                           dispatched: float) -> list[EncodedPart | EncodeError]:
        if self.preprocess_pool is not None and all(self._poolable(job) for job in jobs):
            return await self._encode_pooled(modality, jobs, dispatched)
        for job in jobs:
            self.forget_prefetch(job)
        self.adapter.before_batch(modality, jobs)
        items = [item for job in jobs for item in job.items]
        stages = self._process_then_forward(modality, items)
        prepared, preprocess_s, rows, forward_s, preprocessed, forwarded, cpu = await asyncio.wrap_future(stages)
        self.metrics.preprocess.labels(modality, "processor").observe(preprocess_s)
        return self._parts(modality, jobs, prepared.layouts, rows, preprocess_s, forward_s, "replica=0",
                           (dispatched, preprocessed - preprocess_s, preprocessed, forwarded - forward_s, forwarded),
                           cpu)

    def _process_then_forward(self, modality: str, items: list[Any]) -> concurrent.futures.Future:
        """The processor in its thread, which then hands the batch to the forward's thread itself: the loop
        is woken once per batch, when the forward is done (a wake-up of another thread costs tens of
        microseconds, more on a VM). Resolves to (prepared, processor seconds, rows, forward seconds, when the
        processor ended, when the forward ended, (processor CPU seconds, forward CPU seconds)), times from
        `time.perf_counter`."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def forward(prepared: PreparedBatch, preprocess_s: float, preprocessed: float, prepare_cpu: float) -> None:
            try:
                rows, forward_s, forward_cpu = _timed_with_cpu(self.adapter.forward, prepared)
            except BaseException as exc:
                _settle(done, exception=exc)
                return
            _settle(done, (prepared, preprocess_s, rows, forward_s, preprocessed, time.perf_counter(),
                           (prepare_cpu, forward_cpu)))

        def failed(error: Exception) -> None:
            try:
                self.adapter.preprocess_failed(modality, error)
            finally:
                _settle(done, exception=error)

        def process() -> None:
            try:
                try:
                    prepared, preprocess_s, prepare_cpu = _timed_with_cpu(self.adapter.processor.preprocess,
                                                                          modality, items)
                except Exception as exc:  # the processor failed: the forward's thread says so, in batch order
                    self._forward_pool.submit(failed, exc)
                    return
                # The forward runs even for a batch that does not look right, so that tensor-parallel ranks
                # reach their layout agreement together; the checks come after it.
                self._forward_pool.submit(forward, prepared, preprocess_s, time.perf_counter(), prepare_cpu)
            except BaseException as exc:  # the engine is closing
                _settle(done, exception=exc)

        self._processor_thread.submit(process)
        return done

    async def _encode_pooled(self, modality: str, jobs: Sequence[EncodeJob],
                             dispatched: float) -> list[EncodedPart | EncodeError]:
        """Items prepared in the pool's processes; a job with an item that failed there fails alone."""
        from encode_server.preprocessing.pool import ItemFailure

        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        prepared = await self._prepare_in_pool(modality, jobs)
        preprocess_s = time.perf_counter() - started
        self.metrics.preprocess.labels(modality, "processor").observe(preprocess_s)
        results: list[EncodedPart | EncodeError | None] = [None] * len(jobs)
        kept: list[int] = []
        batches: list[PreparedBatch] = []
        start = 0
        for index, job in enumerate(jobs):
            mine = prepared[start:start + len(job.raw_items)]
            start += len(job.raw_items)
            failure = next((item for item in mine if isinstance(item, ItemFailure)), None)
            if failure is not None:
                results[index] = EncodeError(failure.status, failure.message, job.req_id)
                self.preprocess_pool.release(mine)  # the job's other items are not used
            else:
                kept.append(index)
                batches.extend(mine)
        if kept:
            # The forward's thread gives the items' shared memory back once the forward has read it,
            # even if this coroutine is cancelled meanwhile.
            (layouts, rows), forward_s = await loop.run_in_executor(
                self._forward_pool, _timed, self._collate_and_forward, batches)
            forwarded = time.perf_counter()
            parts = self._parts(modality, [jobs[index] for index in kept], layouts, rows, preprocess_s, forward_s,
                                "replica=0 preprocess=pool",
                                (dispatched, started, started + preprocess_s, forwarded - forward_s, forwarded))
            for index, part in zip(kept, parts):
                results[index] = part
        return results  # type: ignore[return-value]

    async def _prepare_in_pool(self, modality: str, jobs: Sequence[EncodeJob]) -> list[Any]:
        """Every job's items, prepared by the pool, in order: the prefetched jobs' own submissions (claimed,
        in case they have not started), one submission for the others. Cancelled, it discards them all."""
        ahead = {id(job): self._prefetched.pop(id(job))[1] for job in jobs if id(job) in self._prefetched}
        for future in ahead.values():
            self.preprocess_pool.claim(future)
        fresh = [job for job in jobs if id(job) not in ahead]
        submissions = list(ahead.values())
        if fresh:
            submissions.append(self.preprocess_pool.submit(
                modality, [item for job in fresh for item in job.raw_items],
                [location for job in fresh for location in _locations(job)]))
        try:
            await asyncio.wait([asyncio.wrap_future(future) for future in submissions])
        except asyncio.CancelledError:
            for future in submissions:
                self.preprocess_pool.discard(future)
            raise
        fresh_results = iter(submissions[-1].result() if fresh else ())
        prepared: list[Any] = []
        for job in jobs:
            own = ahead.get(id(job))
            prepared.extend(own.result() if own is not None else [next(fresh_results) for _ in job.raw_items])
        return prepared

    def _collate_and_forward(self, batches: list[PreparedBatch]) -> tuple[list[ItemLayout], torch.Tensor]:
        try:
            return self.adapter.forward_items(batches)
        finally:
            self.preprocess_pool.release(batches)

    def _parts(self, modality: str, jobs: Sequence[EncodeJob], layouts: Sequence[ItemLayout], rows: torch.Tensor,
               preprocess_s: float, forward_s: float, where: str,
               times: tuple[float, float, float, float, float],
               cpu: tuple[float, float] = (0.0, 0.0)) -> list[EncodedPart]:
        """Check the batch against what was admitted, then slice it once, per job, by the adapter. `times`
        (`time.perf_counter`): when the batch was dispatched, its preparation started and ended, its forward
        started and ended; they go into the parts of a batch that holds a traced request. `cpu`: the CPU seconds
        of its processor and forward threads, where measured."""
        expected = [layout for job in jobs for layout in job.layouts]
        if list(layouts) != expected:
            raise RuntimeError(f"processor grids {list(layouts)} differ from the admitted layouts {expected}")
        embeddings = self.adapter.split_rows(expected, rows, [len(job.layouts) for job in jobs])
        self.metrics.record_forward(modality, len(expected), rows.shape[0], forward_s)
        batch_id = next(self._batch_ids)
        probe = len(jobs) == 1 and jobs[0].probe
        self.batch_log.batch(modality, batch_id, len(jobs), len(expected), int(rows.shape[0]), preprocess_s,
                             forward_s, where, probe)
        batch = None
        traced = [job.trace for job in jobs if job.trace is not None]
        if traced:  # only a batch that holds a traced request (tracing on, and the request sampled)
            batch = BatchInfo(batch_id, modality, len(jobs), len(expected), int(rows.shape[0]), where, times[0],
                              (times[1], times[2]), (times[3], times[4]))
            batch = traced[0].tracing.batch_span(batch, traced, [job.req_id for job in jobs])
        return [
            EncodedPart(embedding=embedding, layouts=job.layouts, batch_size=len(jobs),
                        timings=Timings(preprocess=(job.decode_s + preprocess_s) * 1e3, encode=forward_s * 1e3,
                                        prepare_cpu=cpu[0] * 1e3, forward_cpu=cpu[1] * 1e3),
                        batch=batch)
            for job, embedding in zip(jobs, embeddings)
        ]
