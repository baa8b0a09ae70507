"""The scheduler and its engine on an event loop of their own, in a thread of their own.

On the HTTP server's loop, the queue's owner waits behind whatever that loop has to do: a burst of
2,000 connections is accepted, parsed and validated in loop iterations of up to 0.25-0.5 s, and a
batching deadline or a finished forward waits that long to be acted on. Here the HTTP loop validates,
decodes, delivers and answers, and the scheduler's loop only queues, decides and dispatches, so its
timers fire on time whatever the HTTP side is doing.

`SchedulerThread` offers the HTTP side what `EncoderScheduler` offers on one loop: `submit` (a future
on the caller's loop; cancelling it drops the job as before), `reprioritize`, `evict_for`, `fail_queued`,
`queue_depth`, `running`, `stop`, and `run(fn)` for anything else that must touch the scheduler or
its engine on their loop. Messages between the loops go through `Mailbox`es that wake their loop
once for however many messages arrived meanwhile (a batch's results cost the HTTP loop one wake-up),
and submissions wake the scheduler only while it has room for a batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from encode_server.ops.thread_names import name_os_thread
from encode_server.records import EncodedPart, EncodeError, EncodeJob
from encode_server.scheduling.mailbox import Mailbox
from encode_server.scheduling.scheduler import EncoderScheduler

T = TypeVar("T")
log = logging.getLogger("encode_server.scheduling.scheduler_thread")

#: How long `evict_for` (called by admission, on the HTTP loop) waits for the scheduler's answer.
EVICT_WAIT_S = 1.0


class SchedulerThread:
    """An `EncoderScheduler` built by `build()` on a new event loop in its own thread, and driven from others."""

    def __init__(self, build: Callable[[], EncoderScheduler], name: str = "encoder-scheduler") -> None:
        self.loop = asyncio.new_event_loop()
        ready = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.result()
        self._replies: dict[asyncio.AbstractEventLoop, Mailbox] = {}
        self._inner: dict[asyncio.Future, asyncio.Future] = {}  # caller's future -> the scheduler's (its loop only)
        self._closed = False
        self.scheduler: EncoderScheduler = self.call(build).result()
        self._inbox = Mailbox(self.loop, wake=self.scheduler.wake)
        self.scheduler.use_mailbox(self._inbox)

    def _serve(self, ready: concurrent.futures.Future) -> None:
        name_os_thread()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set_result, None)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    # --- calls onto the scheduler's loop ---------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run `fn(*args)` on the scheduler's loop; its result (or exception) in a thread-safe future."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if result.set_running_or_notify_cancel():
                try:
                    result.set_result(fn(*args))
                except BaseException as exc:
                    result.set_exception(exc)

        if threading.current_thread() is self._thread:
            run()
        else:
            self.loop.call_soon_threadsafe(run)
        return result

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`call`, awaited from another loop."""
        return await asyncio.wrap_future(self.call(fn, *args))

    # --- what EncoderScheduler offers -------------------------------------------------------------

    def start(self) -> None:
        self.call(self.scheduler.start).result()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.scheduler.running

    @property
    def queue_depth(self) -> int:
        try:
            return self.scheduler.queue_depth
        except RuntimeError:  # its first request of a new modality was being queued meanwhile
            return 0

    @property
    def batches_in_flight(self) -> int:
        return self.scheduler.batches_in_flight

    @property
    def max_in_flight(self) -> int:
        return self.scheduler.max_in_flight

    def overlap_info(self) -> dict[str, object]:
        """The scheduler's choice of batches in flight and why (read across threads: plain values)."""
        return self.scheduler.overlap_info()

    def submit(self, job: EncodeJob, deadline: float, priority: int = 0,
               expires: float | None = None) -> asyncio.Future[EncodedPart]:
        """As `EncoderScheduler.submit`, from the caller's loop: the future is the caller's."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[EncodedPart] = loop.create_future()
        if self._closed:
            future.set_exception(EncodeError(503, "server is shutting down", job.req_id))
            return future
        replies = self._replies.get(loop)
        if replies is None:
            replies = self._replies.setdefault(loop, Mailbox(loop))
        self._inbox.post(self._submit_here, future, replies, job, deadline, priority, expires)
        future.add_done_callback(self._on_caller_done)
        return future

    def reprioritize(self, future: asyncio.Future[EncodedPart], deadline: float, priority: int,
                     expires: float | None = None) -> None:
        """As `EncoderScheduler.reprioritize`, for a future this `submit` gave (posted after its submission,
        so it always finds it queued, dispatched or ended)."""
        self._inbox.post(self._reprioritize_here, future, deadline, priority, expires)

    def _reprioritize_here(self, outer: asyncio.Future, deadline: float, priority: int, expires: float | None) -> None:
        inner = self._inner.get(outer)
        if inner is not None:
            self.scheduler.reprioritize(inner, deadline, priority, expires)

    def _on_caller_done(self, future: asyncio.Future) -> None:
        if future.cancelled():
            self._inbox.post(self._cancel_here, future)

    def _submit_here(self, outer: asyncio.Future, replies: Mailbox, job: EncodeJob, deadline: float,
                     priority: int, expires: float | None) -> None:
        if outer.cancelled():  # its caller gave up before the job got here
            return
        try:
            inner = self.scheduler.submit(job, deadline, priority, expires)
        except Exception as exc:  # a bug: still answer the caller
            replies.post(_fail_unless_done, outer, EncodeError(500, f"could not queue the request: {exc}", job.req_id))
            return
        self._inner[outer] = inner
        inner.add_done_callback(lambda done: self._finished_here(outer, replies, done))

    def _cancel_here(self, outer: asyncio.Future) -> None:
        inner = self._inner.pop(outer, None)
        if inner is not None:
            inner.cancel()

    def _finished_here(self, outer: asyncio.Future, replies: Mailbox, inner: asyncio.Future) -> None:
        self._inner.pop(outer, None)
        replies.post(_settle, outer, inner)

    def evict_for(self, priority: int) -> bool:
        """As `EncoderScheduler.evict_for` (which first queues what was posted); the caller's loop waits for
        the answer, which happens only at the admission cap."""
        try:
            return self.call(self.scheduler.evict_for, priority).result(EVICT_WAIT_S)
        except concurrent.futures.TimeoutError:
            return False

    def fail_queued(self, message: str) -> None:
        self._inbox.post(self.scheduler.fail_queued, message, urgent=True)

    async def stop(self) -> None:
        """Stop the scheduler (what is queued fails with 503, running batches finish), then its loop; a
        submission that raced the stop fails with 503 too."""
        if self._closed:
            return
        self._closed = True
        stopped = asyncio.run_coroutine_threadsafe(self.scheduler.stop(), self.loop)
        await asyncio.wrap_future(stopped)
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 10.0)
        for fn, args in self._inbox.take():
            if fn == self._submit_here:
                outer, replies, job = args[:3]
                replies.post(_fail_unless_done, outer, EncodeError(503, "server is shutting down", job.req_id))


def _settle(outer: asyncio.Future, inner: asyncio.Future) -> None:
    """On the caller's loop: end its future as the scheduler's ended."""
    if outer.done():
        return
    if inner.cancelled():
        outer.cancel()
    elif inner.exception() is not None:
        outer.set_exception(inner.exception())
    else:
        outer.set_result(inner.result())


def _fail_unless_done(outer: asyncio.Future, error: EncodeError) -> None:
    if not outer.done():
        outer.set_exception(error)
