"""The scheduler in-process, on a fake clock and a fake engine: the dispatch rules of
docs/CONTRACT.md section 4 as the running scheduler applies them (max wait, min batch and hard
timeout, dropping the dead, the in-flight limit, probes), asserted without sleeping."""

from __future__ import annotations

import asyncio

import pytest

from encode_server.policy import BatchPolicy
from encode_server.records import EncodeError

from .fakes import FakeEngine, SchedulerRig, job, settle


@pytest.fixture
async def rig():
    """A scheduler on a fake clock; a factory, so each test picks its policy and engine."""
    rig = SchedulerRig(FakeEngine, max_in_flight=2)
    yield rig
    await rig.close()


async def test_an_idle_encoder_takes_a_request_at_once_with_the_default_policy(rig):
    scheduler, engine, clock = rig(BatchPolicy())
    future = scheduler.submit(job("a"), deadline=clock.now() + 10)
    await settle()
    assert engine.batches == [["a"]]
    part = await future
    assert part.timings.queue == 0.0 and part.timings.encode == 1.0


async def test_max_wait_holds_a_lone_request_until_its_wait_is_over(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=0.5))
    future = scheduler.submit(job("a"), deadline=clock.now() + 10)
    await clock.advance(0.49)
    assert engine.batches == [] and not future.done()
    scheduler.submit(job("b"), deadline=clock.now() + 10)
    await clock.advance(0.01)
    assert engine.batches == [["a", "b"]]
    assert (await future).timings.queue == pytest.approx(500.0)


async def test_below_min_batch_the_hard_timeout_releases_what_is_queued(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=0.5, min_batch_size=5, hard_timeout_additional_s=1.0))
    futures = [scheduler.submit(job(name), deadline=clock.now() + 10) for name in "abc"]
    await clock.advance(0.5)
    assert engine.batches == []  # max wait is over, but 3 < min batch 5
    await clock.advance(0.99)
    assert engine.batches == []
    await clock.advance(0.01)
    assert engine.batches == [["a", "b", "c"]]
    assert [(await f).batch_size for f in futures] == [3, 3, 3]


async def test_a_full_batch_goes_at_once_whatever_the_wait(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=3, max_wait_s=100.0, min_batch_size=10))
    for name in "abcd":
        scheduler.submit(job(name), deadline=clock.now() + 1000)
    await settle()
    assert engine.batches == [["a", "b", "c"]]


async def test_an_expired_request_gets_504_and_never_reaches_the_encoder(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=5.0, min_batch_size=10, hard_timeout_additional_s=1.0))
    late = scheduler.submit(job("late"), deadline=clock.now() + 0.5)
    on_time = scheduler.submit(job("on-time"), deadline=clock.now() + 100)
    await clock.advance(0.5)
    assert late.done()
    with pytest.raises(EncodeError) as caught:
        late.result()
    assert caught.value.status == 504 and caught.value.req_id == "late"
    await clock.advance(5.5)  # the hard timeout releases the rest
    assert engine.batches == [["on-time"]]
    await on_time


async def test_a_cancelled_request_is_dropped_before_the_encoder(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=1.0))
    gone = scheduler.submit(job("gone"), deadline=clock.now() + 100)
    kept = scheduler.submit(job("kept"), deadline=clock.now() + 100)
    gone.cancel()  # what a disconnecting or timed-out caller does to the future it awaits
    await clock.advance(1.0)
    assert engine.batches == [["kept"]]
    await kept


async def test_at_most_max_in_flight_batches_and_a_busy_encoder_collects_the_next_batch(rig):
    engine = FakeEngine(hold=True)
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=32), engine=engine, max_in_flight=2)
    first = [scheduler.submit(job(f"r{i}"), deadline=clock.now() + 100) for i in range(2)]
    await settle()
    assert engine.batches == [["r0", "r1"]]  # both arrived before the scheduler ran: one batch
    second = scheduler.submit(job("r2"), deadline=clock.now() + 100)
    await settle()
    later = [scheduler.submit(job(f"r{i}"), deadline=clock.now() + 100) for i in range(3, 6)]
    await settle()
    # Two batches in flight; the rest wait for a slot and then go together.
    assert engine.batches == [["r0", "r1"], ["r2"]] and engine.running == 2
    engine.release()
    await settle()
    assert engine.batches[2] == ["r3", "r4", "r5"] and engine.most_running == 2
    assert [(await f).batch_size for f in (*first, second, *later)] == [2, 2, 1, 3, 3, 3]


async def test_modalities_are_never_fused(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=1.0))
    scheduler.submit(job("img"), deadline=clock.now() + 100)
    scheduler.submit(job("aud", modality="audio"), deadline=clock.now() + 100)
    await clock.advance(1.0)
    assert sorted(engine.batches) == [["aud"], ["img"]]


async def test_probes_run_alone_at_once_and_never_wait_for_company(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=100.0, min_batch_size=10))
    queued = scheduler.submit(job("waiting"), deadline=clock.now() + 1000)
    probe = scheduler.submit(job("probe", probe=True), deadline=clock.now() + 1000)
    await settle()
    assert engine.batches == [["probe"]]
    assert (await probe).batch_size == 1 and not queued.done()


async def test_fail_queued_answers_everything_waiting_with_503(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=100.0, min_batch_size=10))
    futures = [scheduler.submit(job(name), deadline=clock.now() + 1000) for name in "ab"]
    await settle()
    scheduler.fail_queued("rank 1 died")
    for future in futures:
        with pytest.raises(EncodeError) as caught:
            await future
        assert caught.value.status == 503 and "rank 1 died" in caught.value.message
    assert engine.batches == []


async def test_an_idle_scheduler_sleeps_without_a_deadline(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=1.0))
    await settle()
    assert clock._sleepers == []  # nothing queued: it waits for an arrival only, no timer (no polling)
    scheduler.submit(job("a"), deadline=clock.now() + 100)
    await settle()
    assert [deadline for deadline, _ in clock._sleepers] == [pytest.approx(clock.now() + 1.0)]
    await asyncio.sleep(0)
