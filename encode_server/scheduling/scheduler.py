"""The one owner of the queue: `EncoderScheduler` forms batches and hands them to the engine.

Other tasks only `submit` a job and await the future they get back. The scheduler's task drains the
inbox into per-modality queues, drops requests that were cancelled, disconnected or expired, asks
the pure policy (`scheduling.policy.decide`) what to dispatch whenever the engine has room for a batch, and
otherwise sleeps until the next arrival, the next freed slot, or the policy's deadline. It never
polls. Its time comes from an injectable `Clock`, so the rules are tested without sleeping.

Each modality's queue is kept in the policy's order (priority, then deadline, then arrival: a
`PolicyQueue`, O(log n) per submit) and the scheduler takes exactly the positions the policy names,
promotions included. It feeds the learned cost model (`scheduling.cost_model.CostModel`): every arrival, and
the forward time of every fused batch, which `--max-wait-ms auto` and the promotion window read.
At the admission cap, `evict_for(priority)` makes room for a higher-priority newcomer by failing
the queued request the policy would serve last (503 with Retry-After).

In the server it runs on an event loop of its own, in its own thread (`scheduling.scheduler_thread.SchedulerThread`):
submissions and cancellations from the HTTP loop arrive through a `Mailbox` it drains before each
decision, and wake it only while it has room for a batch.

Room for a batch: at most `max_in_flight` batches are between dispatch and the end of their
forward (default 2: one in the forward, the next one preprocessing). So an idle encoder takes a
request at once, and a busy one collects the next batch meanwhile. Where the two contend for the cores
(a CPU forward that leaves no core beside the event loop's) the count follows the measured share of
preparation in a batch's time instead (`overlap`: `scheduling.overlap`): two where preparing is a real
share of it (camera-sized images), one where it is cheap (the queue is not split).

Work ahead: with `prefetch_limit` (an engine with a preprocessing pool), the first `prefetch_limit`
queued requests in the policy's order have their items prepared while they wait (`engine.prefetch`,
work the pool gives only to idle workers), and a batch then takes only those whose items are ready
(with those never prepared ahead): one still being prepared stays queued, in its place, for the next
batch, and its end wakes the scheduler. So the forward takes what is ready whenever it is free, and
the workers keep preparing the rest, instead of both waiting for a batch's slowest item. The service
runs it with one batch in flight. A prefetched request that leaves the queue without being dispatched
has its results given back (`engine.forget_prefetch`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodedPart, EncodeError, EncodeJob
from encode_server.scheduling.clock import Clock, MonotonicClock
from encode_server.scheduling.cost_model import CostModel
from encode_server.scheduling.load import QueueLoad, Running, queue_load
from encode_server.scheduling.mailbox import Mailbox
from encode_server.scheduling.overlap import AdaptiveOverlap
from encode_server.scheduling.policy import BatchPolicy, Dispatch, QueuedView, decide
from encode_server.scheduling.queues import ModalityQueues

log = logging.getLogger("encode_server.scheduling.scheduler")
T = TypeVar("T")


class Engine(Protocol):
    """What the scheduler needs of the engine: one result per job, in order, never raising. With a
    `prefetch_limit`, also `prefetch(job, on_done) -> bool`, `prepared_ahead(job) -> bool` and
    `forget_prefetch(job)` (`EncoderEngine`'s)."""

    async def encode(self, modality: str, jobs: Sequence[EncodeJob]) -> list[EncodedPart | EncodeError]: ...


class PendingRequest:
    """A job waiting for its embedding: the job, the future its caller awaits, and its clock times."""

    __slots__ = ("job", "future", "submit_time", "deadline", "view", "priority", "prefetched")

    def __init__(self, job: EncodeJob, deadline: float, submit_time: float,
                 future: asyncio.Future[EncodedPart], priority: int = 0, expires: float | None = None) -> None:
        self.job = job
        self.future = future
        self.submit_time = submit_time
        self.prefetched = False  # its items are being prepared ahead (`EncoderScheduler._prefetch`)
        self.reprioritize(deadline, priority, expires)

    def reprioritize(self, deadline: float, priority: int, expires: float | None = None) -> None:
        """Set its place in the policy's order (`deadline` in the scheduler's clock) and when it expires."""
        self.deadline = deadline
        self.priority = priority
        self.view = QueuedView(arrival=self.submit_time, tokens=self.job.tokens, priority=priority,
                               deadline=deadline, expires=expires)


def batches_in_flight(on_accelerator: bool, forward_threads: int, cores: int, replicas: int = 1) -> int:
    """How many batches the service keeps between dispatch and the end of their forward (no preprocessing pool).

    Two per replica where the next batch's preparation has somewhere to run beside a forward: a GPU's, or a CPU
    forward that leaves two cores free (one is the event loop's). Otherwise one to start with, and then what the
    measured costs say (`scheduling.overlap`): where preparation is cheap, a second batch in flight only splits
    the queue and makes a request wait for two batches instead of one. Measured on a
    2-core VM, one torch thread, 56x56 images: one batch in flight gave batches of 32 instead of 24 at
    concurrency 64, 801-874 against 611-733 req/s, and an interactive p99 under a 256-deep offline flood of 173
    against 285 ms; on one pinned core, 8-15% more throughput; with 448x448 images, within the noise.
    Data-parallel replicas run their forwards in processes of their own: two each.
    """
    if replicas > 1 or on_accelerator or cores >= forward_threads + 2:
        return 2 * replicas
    return 1


class EncoderScheduler:
    """Owns the per-modality queues; applies the policy; dispatches batches to the engine."""

    def __init__(self, engine: Engine, policy: BatchPolicy, metrics: ServerMetrics, max_in_flight: int = 2,
                 clock: Clock | None = None, costs: CostModel | None = None, prefetch_limit: int = 0,
                 overlap: AdaptiveOverlap | None = None) -> None:
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.overlap = overlap  # when set, `max_in_flight` follows the measured costs (`scheduling.overlap`)
        self.prefetch_limit = prefetch_limit
        self._prefetched = 0  # queued requests whose items are being prepared ahead
        self.clock = clock or MonotonicClock()
        self.costs = costs or CostModel()
        self._inbox: deque[PendingRequest] = deque()
        self._probes: deque[PendingRequest] = deque()
        self._queues: ModalityQueues[PendingRequest] = ModalityQueues()
        self._gone: deque[PendingRequest] = deque()  # cancelled by their callers while queued
        self._by_future: dict[asyncio.Future, PendingRequest] = {}  # submitted and not ended yet
        self._wake = asyncio.Event()
        self._in_flight = 0
        self._batches: dict[asyncio.Task, Running] = {}  # dispatched, their forward not ended yet
        self._task: asyncio.Task | None = None
        self._mailbox: Mailbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def use_mailbox(self, mailbox: Mailbox) -> None:
        """Run what other threads post to `mailbox` before each decision (`SchedulerThread`); such posts
        wake the scheduler only while it has room for a batch (at capacity it waits for one to finish)."""
        self._mailbox = mailbox

    def wake(self) -> None:
        """Look at the queues again now (from this loop)."""
        self._wake.set()

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run `fn(*args)` where the scheduler runs: here, at once. (`SchedulerThread` offers the same calls
        on its own loop, so the service treats both alike.)"""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            result.set_result(fn(*args))
        except Exception as exc:
            result.set_exception(exc)
        return result

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`call`, awaited."""
        return fn(*args)

    @property
    def queue_depth(self) -> int:
        return len(self._inbox) + len(self._queues) + (len(self._mailbox) if self._mailbox is not None else 0)

    @property
    def batches_in_flight(self) -> int:
        return self._in_flight

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def load(self, lanes: int = 1) -> QueueLoad:
        """The queue per modality, the batches in flight and the estimated wait of a newcomer now
        (`scheduling.load`), what was posted meanwhile queued first; `lanes`: the forwards that run side by side."""
        self._absorb_inbox()
        return queue_load(self._queues.views(), self._batches.values(), self.clock.now(), self.costs,
                          self.policy.max_batch_size, self.max_in_flight, lanes)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="encoder-scheduler")

    def fail_queued(self, message: str) -> None:
        """Fail every request still waiting for a batch with 503 (batches already running finish)."""
        self._absorb_inbox()
        while self._probes:
            _fail(self._probes.popleft(), EncodeError(503, message))
        for pending in self._queues.clear():
            self._unqueued(pending)
            _fail(pending, EncodeError(503, message, pending.job.req_id, headers={"Retry-After": "1"}))

    async def stop(self) -> None:
        """Stop dispatching and fail whatever is still queued with 503."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.fail_queued("server is shutting down")
        if self._batches:
            await asyncio.gather(*self._batches, return_exceptions=True)

    def submit(self, job: EncodeJob, deadline: float, priority: int = 0,
               expires: float | None = None) -> asyncio.Future[EncodedPart]:
        """Queue a job (`deadline` in the scheduler's clock; higher `priority` first); the future ends with
        its `EncodedPart` or an `EncodeError`. Cancelling the future drops the job before it reaches the
        encoder. `expires`, when later than `deadline`, is when it fails 504 instead: an encode shared by
        several requests is ordered by the most urgent and lives as long as the last (`demand`)."""
        future: asyncio.Future[EncodedPart] = asyncio.get_running_loop().create_future()
        pending = PendingRequest(job, deadline, self.clock.now(), future, priority, expires)
        self._by_future[future] = pending
        future.add_done_callback(lambda done: self._forget(pending, cancelled=done.cancelled()))
        self._inbox.append(pending)
        self._wake.set()
        return future

    def reprioritize(self, future: asyncio.Future[EncodedPart], deadline: float, priority: int,
                     expires: float | None = None) -> None:
        """Move a submitted job (by the future `submit` gave) to the place its new deadline and priority give
        it; a no-op once it has been dispatched or has ended."""
        pending = self._by_future.get(future)
        if pending is None:
            return
        queued = self._queues.discard(pending.job.modality, pending)
        pending.reprioritize(deadline, priority, expires)
        if queued:
            self._queues.add(pending.job.modality, pending.view, pending)
            self._wake.set()

    def _forget(self, pending: PendingRequest, cancelled: bool) -> None:
        del self._by_future[pending.future]
        if cancelled:
            self._gone.append(pending)
            self._wake.set()

    def evict_for(self, priority: int) -> bool:
        """Make room for a newcomer of `priority` at the admission cap: fail the queued request of lower
        priority that the policy would serve last with 503 (Retry-After). False when there is none."""
        self._absorb_inbox()
        candidate = self._queues.eviction_candidate(priority)
        if candidate is None:
            return False
        modality, pending = candidate
        self._queues.discard(modality, pending)
        self._unqueued(pending)
        self.metrics.evictions.labels(modality, str(pending.priority)).inc()
        _fail(pending, EncodeError(503, f"evicted from the queue by a request of priority {priority}",
                                   pending.job.req_id, headers={"Retry-After": "1"}))
        self._wake.set()
        return True

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            self._absorb_inbox()
            now = self.clock.now()
            self._drop_dead(now)
            timeout: float | None = None
            while self._probes and self._in_flight < self.max_in_flight:
                probe = self._probes.popleft()
                if not probe.future.done():
                    self._start_batch(probe.job.modality, [probe], now)
            while self._in_flight < self.max_in_flight:
                decision = decide(self._queues.views(), now, self.policy, self.costs)
                if isinstance(decision, Dispatch):
                    if self._dispatch(decision, now):
                        continue
                    break  # nothing of it is ready yet: the end of its preparation wakes us
                if decision.until is not None:
                    timeout = max(0.0, decision.until - now)
                break
            self._prefetch()
            self.metrics.queue_depth.set(self.queue_depth)
            # Arrivals wake it while it has room for a batch, or for work ahead.
            room = self._in_flight < self.max_in_flight or self._prefetched < self.prefetch_limit
            if self._mailbox is not None and not self._mailbox.listen(room):
                continue  # posted meanwhile: run it first
            await self.clock.wait(self._wake, timeout)

    def _absorb_inbox(self) -> None:
        if self._mailbox is not None:
            self._mailbox.run_pending()  # submissions and cancellations from other threads, in order
        while self._inbox:
            pending = self._inbox.popleft()
            if pending.job.probe:
                self._probes.append(pending)
            elif not pending.future.done():
                self._queues.add(pending.job.modality, pending.view, pending)
                self.costs.observe_arrival(pending.job.modality, pending.submit_time)

    def _drop_dead(self, now: float) -> None:
        """Requests whose callers gave up (cancelled, disconnected, timed out) never reach the encoder."""
        while self._gone:
            pending = self._gone.popleft()
            if self._queues.discard(pending.job.modality, pending):
                self._unqueued(pending)
        for pending in self._queues.pop_expired(now):
            self._unqueued(pending)
            _fail(pending, EncodeError(504, "timed out waiting in the queue (the request's timeout_s, at most "
                                          "--req-timeout-s)", pending.job.req_id))

    def _prefetch(self) -> None:
        """Start preparing the first `prefetch_limit` queued requests (each modality's queue in the policy's
        order) that are not yet; the engine gives that work only to idle preprocessing workers."""
        room = self.prefetch_limit - self._prefetched
        for queue in self._queues.queues.values():
            if room <= 0:
                return
            for pending in itertools.islice(queue, self.prefetch_limit):  # this queue's first ones
                if room <= 0:
                    break
                if not pending.prefetched and self.engine.prefetch(pending.job, self._wake_from_any_thread):
                    pending.prefetched = True
                    self._prefetched += 1
                    room -= 1

    def _wake_from_any_thread(self) -> None:
        """Work ahead ended (in the pool's thread): look at the queues again."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            self._loop.call_soon_threadsafe(self._wake.set)

    def _unqueued(self, pending: PendingRequest, dispatched: bool = False) -> None:
        """`pending` left the queue: its work ahead no longer counts, and is given back unless dispatched."""
        if pending.prefetched:
            self._prefetched -= 1
            if not dispatched:
                pending.prefetched = False
                self.engine.forget_prefetch(pending.job)

    def _dispatch(self, decision: Dispatch, now: float) -> bool:
        """Start the batch the policy chose, less its requests still being prepared ahead (they stay
        queued); False when that leaves nothing."""
        batch = self._queues.take(decision)
        if self.prefetch_limit:
            batch = self._ready_part(decision.modality, batch)
            if not batch:
                return False
        for pending in batch:
            self._unqueued(pending, dispatched=True)
            self.metrics.record_queue_wait(decision.modality, pending.priority, now - pending.submit_time)
        self.metrics.batch_size.labels(decision.modality).observe(len(batch))
        self._start_batch(decision.modality, batch, now)
        return True

    def _ready_part(self, modality: str, batch: list[PendingRequest]) -> list[PendingRequest]:
        """The requests of `batch` that are ready to encode; those still being prepared go back to the queue."""
        ready = []
        for pending in batch:
            if pending.prefetched and not self.engine.prepared_ahead(pending.job):
                self._queues.add(modality, pending.view, pending)
            else:
                ready.append(pending)
        return ready

    def _start_batch(self, modality: str, batch: list[PendingRequest], now: float) -> None:
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run_batch(modality, batch, now))
        self._batches[task] = Running(modality, sum(pending.view.tokens for pending in batch), now)
        task.add_done_callback(self._batches.pop)

    async def _run_batch(self, modality: str, batch: list[PendingRequest], dispatched_at: float) -> None:
        try:
            live = [p for p in batch if not p.future.done()]
            if not live:
                return
            results = await self.engine.encode(modality, [p.job for p in live])
            self._learn(modality, live, results)
            for pending, result in zip(live, results):
                if isinstance(result, EncodeError):
                    _fail(pending, result)
                elif not pending.future.done():
                    queue_ms = (dispatched_at - pending.submit_time) * 1e3
                    pending.future.set_result(result.with_timings(result.timings.with_queue(queue_ms)))
        except BaseException as exc:  # never leave a caller waiting
            for pending in batch:
                _fail(pending, EncodeError(500, f"batch failed: {exc}", pending.job.req_id))
            if not isinstance(exc, Exception):
                raise
        finally:
            for pending in batch:  # work ahead the engine did not use (the request went meanwhile); else a no-op
                if pending.prefetched:
                    self.engine.forget_prefetch(pending.job)
            self._in_flight -= 1
            self._wake.set()


    def _learn(self, modality: str, live: list[PendingRequest], results: Sequence[EncodedPart | EncodeError]) -> None:
        """Feed a fused forward's time to the cost model (not a batch that failed or was split up)."""
        if not results or not all(isinstance(result, EncodedPart) for result in results):
            return
        if any(result.batch_size != len(live) for result in results):
            return
        timings = results[0].timings
        self.costs.observe_batch(modality, len(live), sum(p.job.tokens for p in live), timings.encode / 1e3)
        if self.overlap is not None and timings.forward_cpu > 0:  # the threads' CPU, not wall times (`overlap`)
            choice = self.overlap.observe(timings.prepare_cpu / 1e3, timings.forward_cpu / 1e3)
            if choice.in_flight != self.max_in_flight:
                log.info("scheduler: up to %d batch(es) in flight: %s", choice.in_flight, choice.reason)
                self.max_in_flight = choice.in_flight

    def overlap_info(self) -> dict[str, object]:
        """How many batches may be in flight and why (`/server_info`)."""
        if self.overlap is not None:
            return self.overlap.summary()
        return {"adaptive": False, "batches_in_flight": self.max_in_flight}


def _fail(pending: PendingRequest, error: EncodeError) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)
