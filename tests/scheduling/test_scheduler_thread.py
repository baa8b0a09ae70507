"""The scheduler on its own loop and thread (`scheduling/scheduler_thread.py`), driven from another loop: results,
fusing, cancellation, eviction, stopping, and a blocked caller's loop not delaying a batch. Real clock
and threads; the engine is the fake one, so each test takes well under a second."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodeError
from encode_server.scheduling.mailbox import Mailbox
from encode_server.scheduling.policy import BatchPolicy
from encode_server.scheduling.scheduler import EncoderScheduler
from encode_server.scheduling.scheduler_thread import SchedulerThread
from tests.support.fakes import FakeEngine, job, until

pytestmark = pytest.mark.quick


class RecordingEngine(FakeEngine):
    """A fake engine that notes the thread and the time each batch reached it."""

    def __init__(self, hold: bool = False) -> None:
        super().__init__(hold=hold)
        self.threads: list[str] = []
        self.started_at: list[float] = []

    async def encode(self, modality, jobs):
        self.threads.append(threading.current_thread().name)
        self.started_at.append(time.monotonic())
        return await super().encode(modality, jobs)


def threaded(engine: RecordingEngine, policy: BatchPolicy | None = None, max_in_flight: int = 1) -> SchedulerThread:
    scheduler = SchedulerThread(lambda: EncoderScheduler(engine, policy or BatchPolicy(), ServerMetrics(),
                                                         max_in_flight=max_in_flight))
    scheduler.start()
    return scheduler


def test_mailbox_runs_posts_in_order_with_one_wake_up_per_burst():
    loop = asyncio.new_event_loop()
    wakes: list[int] = []
    mailbox = Mailbox(loop, wake=lambda: wakes.append(1))
    ran: list[int] = []
    for value in range(5):
        mailbox.post(ran.append, value)
    assert len(mailbox) == 5 and ran == []
    loop.run_until_complete(asyncio.sleep(0))
    assert wakes == [1]  # five posts, one wake-up
    mailbox.run_pending()
    assert ran == [0, 1, 2, 3, 4] and len(mailbox) == 0
    # A consumer with no room does not want waking; a post it has not run yet keeps it awake.
    assert mailbox.listen(False) is True
    mailbox.post(ran.append, 5)
    loop.run_until_complete(asyncio.sleep(0))
    assert wakes == [1]
    assert mailbox.listen(True) is False  # run it first
    mailbox.post(ran.append, 6, urgent=True)
    loop.run_until_complete(asyncio.sleep(0))
    assert wakes == [1, 1]
    mailbox.run_pending()
    assert ran == list(range(7))
    loop.close()


def test_mailbox_keeps_the_order_of_posts_from_many_threads():
    loop = asyncio.new_event_loop()
    mailbox = Mailbox(loop)
    ran: list[tuple[int, int]] = []

    def poster(name: int) -> None:
        for index in range(200):
            mailbox.post(ran.append, (name, index))

    threads = [threading.Thread(target=poster, args=(name,)) for name in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    loop.run_until_complete(asyncio.sleep(0.01))
    assert len(ran) == 800
    for name in range(4):
        assert [index for who, index in ran if who == name] == list(range(200))
    loop.close()


@pytest.fixture
async def held():
    """A started `SchedulerThread` whose holding engine is busy with a batch of one: (engine, scheduler,
    that batch's future). Release the engine with `scheduling.scheduler.call(engine.release)` (its gate lives on the
    scheduler's loop)."""
    engine = RecordingEngine(hold=True)
    scheduler = threaded(engine)
    busy = scheduler.submit(job("busy"), deadline=time.monotonic() + 10)
    await until(lambda: len(engine.batches) == 1)
    yield engine, scheduler, busy
    await scheduler.stop()


async def test_jobs_run_on_the_scheduler_thread_and_results_come_back_to_the_caller(held):
    engine, scheduler, busy = held
    rest = [scheduler.submit(job(name), deadline=time.monotonic() + 10) for name in "bcd"]
    await until(lambda: scheduler.queue_depth == 3)
    scheduler.call(engine.release)
    parts = await asyncio.gather(busy, *rest)
    assert engine.batches == [["busy"], ["b", "c", "d"]]  # what queued behind the busy engine was fused
    assert [part.batch_size for part in parts] == [1, 3, 3, 3]
    assert set(engine.threads) == {"encoder-scheduler"}
    assert threading.current_thread().name != "encoder-scheduler"


async def test_a_cancelled_caller_never_reaches_the_engine(held):
    engine, scheduler, busy = held
    gone = scheduler.submit(job("gone"), deadline=time.monotonic() + 10)
    kept = scheduler.submit(job("kept"), deadline=time.monotonic() + 10)
    gone.cancel()
    await asyncio.sleep(0.05)
    scheduler.call(engine.release)
    await asyncio.gather(busy, kept)
    assert engine.batches == [["busy"], ["kept"]]


async def test_eviction_at_the_cap_answers_from_the_scheduler_thread(held):
    engine, scheduler, busy = held
    low = scheduler.submit(job("low"), deadline=time.monotonic() + 10, priority=0)
    assert scheduler.evict_for(0) is False  # nothing of lower priority than 0
    assert scheduler.evict_for(2) is True
    with pytest.raises(EncodeError) as raised:
        await low
    assert raised.value.status == 503 and "evicted" in raised.value.message
    scheduler.call(engine.release)
    await busy


async def test_stop_fails_what_is_queued_and_later_submissions_with_503(held):
    engine, scheduler, busy = held
    queued = scheduler.submit(job("queued"), deadline=time.monotonic() + 10)
    stopping = asyncio.ensure_future(scheduler.stop())
    with pytest.raises(EncodeError) as raised:
        await queued  # failed at once, while the running batch goes on
    assert raised.value.status == 503
    scheduler.call(engine.release)
    await stopping
    await busy  # the running batch finished
    with pytest.raises(EncodeError) as late:
        await scheduler.submit(job("late"), deadline=time.monotonic() + 10)
    assert late.value.status == 503 and not scheduler.running


async def test_a_blocked_caller_loop_does_not_delay_the_batch():
    engine = RecordingEngine()
    scheduler = threaded(engine)
    try:
        submitted = time.monotonic()
        future = scheduler.submit(job("a"), deadline=submitted + 10)
        time.sleep(0.3)  # the caller's loop (the HTTP side) is busy; the scheduler's is not
        blocked_until = time.monotonic()
        await future
        assert engine.started_at[0] < blocked_until - 0.1
    finally:
        await scheduler.stop()
