"""Decode and preprocess media items in worker processes, so that preprocessing runs on every core.

`PreprocessPool` starts `workers` processes (from a fork server that has imported what they need:
`preprocessing.process.worker_context`), each holding the adapter's processor (`adapter.processor`, pickled as
it is: a processor holds no model) and one torch thread. A task is one item: its raw file bytes (a list of image
files for a video given as frames) and its modality; the worker decodes it with the
functions and limits of `media/decoding.py` (as the server's own decode threads do), checks its layout
(`item_layout`) and runs the processor's `preprocess` on that item alone. `collate` then fuses a batch's
per-item results in order into what one `preprocess` over the batch would give.

Pixels never go through pickle: the worker (`preprocessing/worker.py`) writes the item's input tensors
into POSIX shared memory (`preprocessing/shared_tensors.py`: one of its reusable slots, else a one-off block) and
sends only their description and the layouts; the pool maps it and hands out views (the forward reads
them directly, or `collate` copies them once into the batch's tensors). An item in a slot is a
`PooledItem`: `release` gives the slot back to its worker once the forward has read it.

One background thread, the conductor, owns the workers (a `preprocessing.process.WorkerHandle` each:
starting, reaping and stopping its process): it gives each idle worker the next task (one task per
worker at a time, so an item goes to whichever worker is free first and a crash is attributed to
exactly one item), receives results, and watches the processes' sentinels. An item the
worker cannot use fails alone (`ItemFailure`: 400 with the media or processor's message). A worker
that dies is restarted, and the item it held is tried once more on the next free worker; a second
crash fails that item with a 500 naming the signal.

`submit(..., spare=True)` is for work ahead of need (the scheduler preprocesses queued requests while
the forward is busy, `EncoderEngine.prefetch`): such items go to a worker only when no other item is
waiting (`preprocessing.tasks.TaskQueue`), so they fill idle workers and never delay a dispatched batch;
`claim` puts them first among spare work once their batch is dispatched, and `discard` drops a
submission nobody will read. A worker holding one item longer than
`item_timeout_s` is killed and its item failed. Every wait is bounded: callers get an answer for
every item even when workers keep dying (after `max_start_failures` crashes at start-up in a row the
pool gives up and fails what it holds).

    pool = PreprocessPool(adapter, MediaLimits.from_settings(settings, adapter), workers=4)
    pool.start()                                   # blocks until every worker is ready
    results = await pool.prepare("image", [jpeg_bytes, png_bytes])   # PreparedBatch | ItemFailure
    batch = adapter.processor.collate([r for r in results if isinstance(r, PreparedBatch)])
    rows = adapter.forward(batch)
    pool.release(results)                          # their shared memory is the workers' again
    pool.close()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from encode_server.media.decoding import MediaLimits
from encode_server.models import EncoderAdapter, PreparedBatch
from encode_server.ops.cores import usable_cores
from encode_server.preprocessing.process import WorkerHandle, worker_context
from encode_server.preprocessing.shared_tensors import SHM_DIR, SharedTensors, import_tensors, remove_stale_blocks
from encode_server.preprocessing.tasks import Submission, SubmissionFuture, Task, TaskQueue

log = logging.getLogger("encode_server.preprocessing.pool")


def default_preprocess_workers(cores: int | None = None) -> int:
    """The default `--preprocess-workers`: every core this process may run on but one, at least two.

    The spare core is for the event loop and the thread that drives the forward (on a GPU, launching
    kernels; on a CPU, torch's own threads share it). With two cores both go to workers anyway: camera
    images cost tens of milliseconds of preprocessing each against well under one of loop work, so a
    worker per core beats keeping one core for a mostly idle loop. One core: 0 (in-process, as before).
    """
    if cores is None:
        cores = usable_cores()
    return 0 if cores < 2 else max(2, cores - 1)


@dataclass(frozen=True)
class ItemFailure:
    """An item the pool could not prepare: the HTTP status its request gets and why, naming the item."""

    status: int  # 400: the item itself (undecodable, too small, ...); 500: the pool (a crash, a timeout)
    message: str


class PoolError(RuntimeError):
    """The pool could not start, or is closed."""


@dataclass
class PooledItem(PreparedBatch):
    """An item whose tensors are views of one of its worker's reusable shared-memory slots: hand it to
    `PreprocessPool.release` once nothing reads them any more (after the forward), and the worker
    writes later items there."""

    lease: tuple[int, int, int] | None = None  # (worker index, worker generation, slot id)


# --- the pool ----------------------------------------------------------------------------------------

class PreprocessPool:
    """`workers` processes that decode and preprocess items; see the module docstring."""

    def __init__(self, adapter: EncoderAdapter, limits: MediaLimits, workers: int, *, threads_per_worker: int = 1,
                 item_timeout_s: float = 120.0, start_timeout_s: float = 180.0, max_start_failures: int = 3) -> None:
        if workers < 1:
            raise ValueError(f"a preprocessing pool needs at least one worker, got {workers}")
        self.adapter = adapter
        self.limits = limits
        self.size = workers
        self.threads_per_worker = threads_per_worker
        self.item_timeout_s = item_timeout_s
        self.start_timeout_s = start_timeout_s
        self.max_start_failures = max_start_failures
        self.broken: str | None = None  # why the pool can no longer prepare anything
        self._processor = adapter.processor
        self._context = worker_context(self._processor)
        self._block_prefix = str(SHM_DIR / f"encode-preprocess-{os.getpid()}-{id(self):x}")
        self._workers = [WorkerHandle(index) for index in range(workers)]
        self._inbox: deque[tuple[Submission, list[Task]]] = deque()
        self._inbox_lock = threading.Lock()
        self._release_lock = threading.Lock()  # `release` runs in the forward's thread
        self._stopped = False  # set once, by the conductor as it exits; submit() then fails at once
        self._queue = TaskQueue()
        self._task_ids = itertools.count()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)
        self._closing = False
        self._all_ready = threading.Event()
        self._conductor: threading.Thread | None = None
        self._started_at = 0.0

    # --- public API ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the workers and wait (at most `start_timeout_s`) until every one is ready."""
        remove_stale_blocks()
        self._started_at = time.perf_counter()
        for worker in self._workers:
            self._spawn(worker)
        self._conductor = threading.Thread(target=self._conduct, name="preprocess-conductor", daemon=True)
        self._conductor.start()
        if not self._all_ready.wait(self.start_timeout_s):
            self.close()
            raise PoolError(f"preprocessing workers were not ready within {self.start_timeout_s:g} s")
        if self.broken:
            message = self.broken
            self.close()
            raise PoolError(message)

    def submit(self, modality: str, items: Sequence[bytes | list[bytes]],
               locations: Sequence[str] | None = None, spare: bool = False) -> SubmissionFuture:
        """A future of one `PreparedBatch` (a single item's) or `ItemFailure` per item, in order. `spare`
        items wait until no other item does (see the module docstring)."""
        future = SubmissionFuture()  # left pending (not running), so that cancelling it drops its items
        if not items:
            future.set_result([])
            return future
        submission = future.submission = Submission(future, modality, [None] * len(items), len(items), spare)
        locations = locations or [f"mm_items[{index}]" for index in range(len(items))]
        tasks = [Task(submission, index, raw, location) for index, (raw, location) in enumerate(zip(items, locations))]
        with self._inbox_lock:  # the conductor's last drain takes the same lock: nothing is left behind
            if not self._stopped:
                self._inbox.append((submission, tasks))
                self._wake()
                return future
        future.set_result([ItemFailure(503, self.broken or "the preprocessing pool is shut down")] * len(items))
        return future

    def claim(self, future: SubmissionFuture) -> None:
        """The items of a `spare` submission are needed now: they go before other spare work."""
        if future.submission is not None:  # None: it had no items, and is answered already
            future.submission.spare = False  # read by the conductor when it next picks a task: no lock, no wake needed

    def discard(self, future: Future) -> None:
        """Nobody will read this submission: its items not started are dropped, and the slots of those done
        (now or later) go back to their workers."""
        if not future.cancel():  # already answered (a submission's future never runs)
            future.add_done_callback(lambda done: self.release(done.result()))

    async def prepare(self, modality: str, items: Sequence[bytes | list[bytes]],
                      locations: Sequence[str] | None = None) -> list[PreparedBatch | ItemFailure]:
        """`submit`, awaited; cancelling it `discard`s the submission."""
        future = self.submit(modality, items, locations)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.discard(future)
            raise

    def release(self, results: Sequence[PreparedBatch | ItemFailure]) -> None:
        """Give the slots of these items back to their workers. Call it once nothing reads their tensors
        (after the forward, or at once for items not used); calling it twice is harmless. An item held
        forever only costs its worker one slot: it falls back to one-off blocks when it has none."""
        with self._release_lock:
            for result in results:
                lease = getattr(result, "lease", None)
                if lease is None:
                    continue
                result.lease = None
                index, generation, slot = lease
                worker = self._workers[index]
                if worker.generation == generation:  # a restarted worker has new slots
                    worker.released.append(slot)

    def stats(self) -> list[dict[str, float]]:
        """Per worker: items done (and how many came back in a reusable slot), busy and CPU seconds, their
        fraction of the pool's lifetime, restarts."""
        wall = max(1e-9, time.perf_counter() - self._started_at)
        return [worker.stats(wall) for worker in self._workers]

    def in_flight(self) -> dict[int, str]:
        """A snapshot: the item (its location) that each busy worker holds, by process id."""
        snapshot = {}
        for worker in list(self._workers):
            process, task = worker.process, worker.task
            if process is not None and task is not None:
                snapshot[process.pid] = task.location
        return snapshot

    def pids(self) -> list[int]:
        """The live workers' process ids (tests kill them)."""
        return [w.process.pid for w in self._workers if w.process is not None and w.process.is_alive()]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (asked, then killed after `timeout_s`), fail what is left, free shared memory."""
        self._closing = True
        self._wake()
        if self._conductor is not None and self._conductor is not threading.current_thread():
            self._conductor.join(timeout_s + 5.0)
        if self._conductor is None or not self._conductor.is_alive():
            with self._inbox_lock:  # never started (or gone): nothing will take what is queued, so fail it
                self._stopped = True
            self._fail_everything(self.broken or "the preprocessing pool is shut down", 503)
            self._stop_workers(timeout_s)
        for fd in (self._wake_read, self._wake_write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_read = self._wake_write = -1

    # --- the conductor thread -------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except (BlockingIOError, OSError):  # already awake (pipe full) or closing
            pass

    def _spawn(self, worker: WorkerHandle) -> None:
        with self._release_lock:  # `release` must not hand the new process the old one's slots
            worker.generation += 1
            worker.released = []
        worker.start(self._context, self._processor, self.limits, self._block_prefix, self.threads_per_worker)

    def _conduct(self) -> None:
        try:
            while not self._closing:
                self._absorb_inbox()
                self._dispatch()
                waitables = [self._wake_read]
                for worker in self._workers:
                    if worker.process is not None:
                        waitables += [worker.results, worker.process.sentinel]
                ready = multiprocessing.connection.wait(waitables, self._wait_timeout())
                for obj in ready:
                    if obj == self._wake_read:
                        os.read(self._wake_read, 4096)
                for worker in self._workers:
                    if worker.process is None:
                        continue
                    if worker.results in ready and not self._receive(worker):
                        worker.process.kill()  # its pipe ended, so it is dying anyway: do not spin on EOF
                        worker.process.join(5.0)
                        self._worker_died(worker)
                        continue
                    if worker.process is not None and worker.process.sentinel in ready:
                        self._worker_died(worker)
                self._expire_overdue()
                self._restart_due()
        except Exception:
            log.exception("the preprocessing conductor failed")
            self.broken = "the preprocessing pool's conductor thread failed"
        finally:
            with self._inbox_lock:
                self._stopped = True
            self._fail_everything(self.broken or "the preprocessing pool is shut down", 503)
            self._all_ready.set()
            self._stop_workers(5.0)

    def _absorb_inbox(self) -> None:
        while self._inbox:
            submission, tasks = self._inbox.popleft()
            for task in tasks:
                task.task_id = next(self._task_ids)
            self._queue.add(submission, tasks)

    def _dispatch(self) -> None:
        for worker in self._workers:
            if not self._queue:
                return
            if worker.process is None or not worker.ready or worker.task is not None:
                continue
            task = self._queue.take()
            if task is None:
                return
            with self._release_lock:
                released, worker.released = worker.released, []
            try:
                worker.tasks.send((task.task_id, task.submission.modality, task.raw, task.location, released))
            except (BrokenPipeError, OSError):
                self._queue.retry(task)  # its sentinel fires next; the item goes to another worker
                continue
            worker.task, worker.task_started = task, time.monotonic()
            worker.ahead_items += task.submission.spare

    def _wait_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [w.task_started + self.item_timeout_s for w in self._workers if w.task is not None]
        deadlines += [w.pending_restart_at for w in self._workers if w.pending_restart_at is not None]
        return max(0.0, min(deadlines) - now) + 0.001 if deadlines else 1.0

    def _receive(self, worker: WorkerHandle) -> bool:
        """Take one message from a worker; False at the end of its pipe (the process is gone)."""
        try:
            kind, task_id, payload, timings = worker.results.recv()
        except (EOFError, OSError):
            return False  # its sentinel says so too: `_worker_died` cleans up
        if kind == "ready":
            worker.ready, worker.start_failures = True, 0
            self._check_all_ready()
            return True
        if kind == "broken":
            log.error("preprocessing worker %d cannot prepare the sample item: %s", worker.index, payload)
            self.broken = f"preprocessing worker {worker.index} cannot prepare the model's sample item: {payload}"
            self._closing = True
            return True
        task, worker.task = worker.task, None
        if task is None or task.task_id != task_id:
            log.error("preprocessing worker %d answered task %s it was not given", worker.index, task_id)
            return True
        if kind == "done":
            inputs, layouts, extras = payload
            try:
                result: PreparedBatch | ItemFailure
                if isinstance(inputs, SharedTensors) and inputs.slot is not None:
                    result = PooledItem(task.submission.modality, worker.slots.read(inputs), layouts, extras,
                                        lease=(worker.index, worker.generation, inputs.slot))
                    worker.slot_items += 1
                else:
                    tensors = import_tensors(inputs) if isinstance(inputs, SharedTensors) else inputs
                    result = PreparedBatch(task.submission.modality, tensors, layouts, extras)
            except OSError as exc:
                result = ItemFailure(500, f"{task.location}: could not map the preprocessed tensors: {exc}")
                if isinstance(inputs, SharedTensors) and inputs.slot is not None:
                    with self._release_lock:
                        worker.released.append(inputs.slot)
            worker.busy_s += timings[0]
            worker.cpu_s += timings[1]
            worker.items += 1
        else:
            status, message = payload
            result = ItemFailure(status, message)
        self._settle(task, result)
        return True

    def _settle(self, task: Task, result: PreparedBatch | ItemFailure) -> None:
        submission = task.submission
        if submission.results[task.index] is not None:
            self.release([result])
            return
        submission.results[task.index] = result
        submission.remaining -= 1
        if submission.remaining == 0 and not submission.future.done():
            try:
                submission.future.set_result(submission.results)
            except Exception:  # cancelled by its caller meanwhile
                pass
        if submission.future.cancelled():  # nobody will read these: their slots go back now
            self.release([r for r in submission.results if r is not None])

    def _worker_died(self, worker: WorkerHandle) -> None:
        while worker.results.poll(0) and self._receive(worker):  # answers sent before it died still count
            pass
        process, was_ready = worker.process, worker.ready
        reason = worker.reap(self._block_prefix)
        task, worker.task = worker.task, None
        if self._closing:
            return
        if task is not None:
            task.attempts += 1
            if task.attempts >= 2:
                self._settle(task, ItemFailure(500, f"{task.location}: the preprocessing worker died twice while "
                                                    f"preparing this item (last {reason})"))
            else:
                log.warning("preprocessing worker %d (pid %d) %s while preparing %s; retrying it once",
                            worker.index, process.pid, reason, task.location)
                self._queue.retry(task)
        else:
            log.warning("preprocessing worker %d (pid %d) %s", worker.index, process.pid, reason)
        worker.exit_reasons.append(reason)
        if not was_ready:
            worker.start_failures += 1
        if worker.start_failures >= self.max_start_failures:
            log.error("preprocessing worker %d failed to start %d times in a row; not restarting it",
                      worker.index, worker.start_failures)
            worker.gave_up = True
            if all(w.gave_up for w in self._workers):
                self.broken = (f"every preprocessing worker failed to start {self.max_start_failures} times in "
                               f"a row (last {reason})")
                self._closing = True  # the conductor exits and fails whatever is held
            self._check_all_ready()
            return
        worker.restarts += 1
        # A worker that dies at start-up is restarted after a pause, so that a broken set-up does not spin.
        worker.pending_restart_at = time.monotonic() + (0.0 if was_ready else 1.0)

    def _check_all_ready(self) -> None:
        if all(w.ready or w.gave_up for w in self._workers):
            self._all_ready.set()

    def _restart_due(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            if worker.process is None and worker.pending_restart_at is not None and worker.pending_restart_at <= now:
                self._spawn(worker)

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for worker in self._workers:
            task = worker.task
            if task is not None and now - worker.task_started > self.item_timeout_s:
                log.error("preprocessing worker %d spent over %g s on %s; stopping it", worker.index,
                          self.item_timeout_s, task.location)
                worker.task = None
                task.attempts = 2  # no retry: the item itself is the likely cause
                self._settle(task, ItemFailure(500, f"{task.location}: preprocessing took longer than "
                                                    f"{self.item_timeout_s:g} s"))
                worker.process.kill()  # its sentinel fires; the conductor restarts it

    def _fail_everything(self, message: str, status: int) -> None:
        self._absorb_inbox()
        failure = ItemFailure(status, message)
        for worker in self._workers:
            if worker.task is not None:
                task, worker.task = worker.task, None
                self._settle(task, failure)
        for task in self._queue.drain():
            self._settle(task, failure)

    def _stop_workers(self, timeout_s: float) -> None:
        for worker in self._workers:
            worker.ask_to_stop()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            worker.stop(deadline)
        for path in SHM_DIR.glob(Path(f"{self._block_prefix}-*").name):
            path.unlink(missing_ok=True)
