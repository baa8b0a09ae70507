"""Priorities, deadlines and adaptive waiting in the running scheduler, on a fake clock and a fake engine:
priority order, promotion near the deadline, eviction at the cap, expiry, and the cost model it feeds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from encode_server.records import EncodedPart, EncodeError, Timings
from encode_server.scheduling.policy import BatchPolicy
from tests.support.fakes import FakeEngine, SchedulerRig, job, settle

pytestmark = pytest.mark.quick


class StepEngine(FakeEngine):
    """Holds each batch until `finish_running` lets exactly the oldest one finish."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[asyncio.Event] = []

    async def encode(self, modality, jobs):
        self.batches.append([job.req_id for job in jobs])
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return [EncodedPart(embedding=torch.zeros((job.tokens, 4)), layouts=job.layouts, batch_size=len(jobs),
                            timings=Timings(encode=1.0)) for job in jobs]

    def release(self) -> None:
        for gate in self.gates:
            gate.set()



@pytest.fixture
async def rig():
    rig = SchedulerRig(StepEngine, max_in_flight=1)
    yield rig
    await rig.close()


async def finish_running(engine: StepEngine) -> None:
    """Let the oldest held batch finish (the scheduler then dispatches the next one)."""
    next(gate for gate in engine.gates if not gate.is_set()).set()
    await settle()


async def test_higher_priority_requests_leave_first_then_earliest_deadline(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=2))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    assert engine.batches == [["busy"]]  # the encoder is now busy; the rest queue up
    scheduler.submit(job("low-a"), now + 60)
    scheduler.submit(job("low-b"), now + 30)
    scheduler.submit(job("high"), now + 60, priority=1)
    await finish_running(engine)
    assert engine.batches[1] == ["high", "low-b"]
    await finish_running(engine)
    assert engine.batches[2] == ["low-a"]


async def test_a_request_near_its_deadline_is_promoted_and_not_failed(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=2, deadline_margin_s=0.5))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    low = scheduler.submit(job("low"), now + 2.0)
    for name in ("h1", "h2", "h3"):
        scheduler.submit(job(name), now + 60, priority=1)
    await clock.advance(1.0)
    await finish_running(engine)
    assert engine.batches[1] == ["h1", "h2"]  # not urgent yet: priority order
    await clock.advance(0.6)  # now within 0.5 s of its deadline
    await finish_running(engine)
    assert engine.batches[2] == ["low", "h3"]
    engine.release()
    await settle()
    assert (await low).batch_size == 2


async def test_expired_requests_fail_504_and_never_reach_the_encoder(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=4, deadline_margin_s=0.0))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    doomed = scheduler.submit(job("doomed"), now + 1.0, priority=3)
    scheduler.submit(job("fine"), now + 60)
    await clock.advance(1.0)
    assert doomed.done() and doomed.exception().status == 504
    await finish_running(engine)
    assert engine.batches[1] == ["fine"]


async def test_a_job_moved_forward_by_a_more_urgent_or_important_waiter_leaves_earlier(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=1))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    scheduler.submit(job("first"), now + 30)
    shared = scheduler.submit(job("shared"), now + 60, expires=now + 60)
    scheduler.submit(job("important"), now + 60, priority=1)
    scheduler.reprioritize(shared, now + 10, 2, now + 60)  # a request of priority 2 joined it
    await finish_running(engine)
    assert engine.batches[1] == ["shared"]
    scheduler.reprioritize(shared, now + 1, 5)  # dispatched already: nothing moves
    await finish_running(engine)
    assert engine.batches[2] == ["important"]


async def test_a_moved_job_is_promoted_before_its_new_deadline(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_wait_s=5.0, min_batch_size=10, hard_timeout_additional_s=5.0,
                                               deadline_margin_s=0.1))
    now = clock.now()
    shared = scheduler.submit(job("shared"), now + 180, expires=now + 180)
    await clock.advance(0.1)
    assert engine.batches == []
    scheduler.reprioritize(shared, now + 0.3, 0, now + 180)  # a request with 0.3 s to live joined
    await clock.advance(0.1)
    assert engine.batches == [["shared"]]


async def test_a_shared_job_outlives_its_most_urgent_deadline_until_it_expires(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=4, deadline_margin_s=0.0))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    shared = scheduler.submit(job("shared"), now + 1.0, expires=now + 5.0)
    alone = scheduler.submit(job("alone"), now + 1.0)
    behind = scheduler.submit(job("behind"), now + 2.0)

    async def look_at(seconds: float) -> None:  # a busy scheduler looks at its queue when woken
        await clock.advance(seconds)
        scheduler.wake()
        await settle()

    await look_at(1.0)
    assert alone.done() and alone.exception().status == 504
    assert not shared.done() and not behind.done()
    await look_at(1.0)
    assert behind.done() and behind.exception().status == 504 and not shared.done()
    await look_at(2.9)
    assert not shared.done()
    await look_at(0.1)
    assert shared.done() and shared.exception().status == 504
    await finish_running(engine)
    assert engine.batches == [["busy"]]


async def test_eviction_fails_the_request_served_last_with_503_and_retry_after(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=4))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    old_low = scheduler.submit(job("old-low"), now + 60)
    new_low = scheduler.submit(job("new-low"), now + 60)
    mid = scheduler.submit(job("mid"), now + 60, priority=1)
    assert scheduler.evict_for(0) is False  # equal priority never evicts
    assert scheduler.evict_for(2) is True
    error = new_low.exception()
    assert isinstance(error, EncodeError) and error.status == 503 and error.headers == {"Retry-After": "1"}
    assert not old_low.done() and not mid.done()
    assert scheduler.evict_for(1) is True and old_low.exception().status == 503
    assert scheduler.evict_for(1) is False  # only the priority-1 request is left
    assert scheduler.metrics.registry.get_sample_value(
        "encoder_evictions_total", {"modality": "image", "priority": "0"}) == 2.0
    await finish_running(engine)
    assert engine.batches[1] == ["mid"]


async def test_a_cancelled_request_leaves_the_queue(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=4))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    gone = scheduler.submit(job("gone"), now + 60)
    scheduler.submit(job("kept"), now + 60)
    gone.cancel()
    await settle()
    assert scheduler.queue_depth == 1
    await finish_running(engine)
    assert engine.batches[1] == ["kept"]


async def test_queue_wait_is_recorded_by_priority(rig):
    scheduler, engine, clock = rig(BatchPolicy(max_batch_size=4))
    now = clock.now()
    scheduler.submit(job("busy"), now + 60)
    await settle()
    scheduler.submit(job("hi"), now + 60, priority=2)
    await clock.advance(0.25)
    await finish_running(engine)
    value = scheduler.metrics.registry.get_sample_value(
        "encoder_queue_wait_seconds_sum", {"modality": "image", "priority": "2"})
    assert value == pytest.approx(0.25)


async def test_the_cost_model_learns_from_forwards_and_auto_waits_for_company(rig):
    policy = BatchPolicy(max_batch_size=8, adaptive_wait=True, target_utilization=0.8, hard_timeout_additional_s=1.0)
    scheduler, engine, clock = rig(policy, engine=FakeEngine(), max_in_flight=1)
    # Teach it a forward of 10 ms + 1 ms per request (the fake engine reports 1 ms; feed the model directly,
    # as the scheduler does from each fused batch), and 400 requests per second.
    for size in (1, 2, 3, 5, 8, 4, 6, 7, 2, 1):
        scheduler.costs.observe_batch("image", size, size * 4, 0.010 + 0.001 * size)
    for i in range(100):
        scheduler.costs.observe_arrival("image", clock.now() - 0.25 + i / 400.0)
    await clock.advance(0.0025)
    scheduler.submit(job("a"), clock.now() + 60)
    await settle()
    assert engine.batches == []  # k* = 400*0.010/(0.8-0.4) = 10 -> capped at 8: wait for company
    for name in "bcdefgh":
        scheduler.submit(job(name), clock.now() + 60)
    await settle()
    assert engine.batches == [list("abcdefgh")]
    # The fake engine's forward (1 ms for 8 requests of 4 tokens) was fed to the model.
    assert scheduler.costs._of("image").batches == 11


async def test_auto_dispatches_at_once_on_a_cold_start(rig):
    scheduler, engine, clock = rig(BatchPolicy(adaptive_wait=True), engine=FakeEngine())
    scheduler.submit(job("a"), clock.now() + 60)
    await settle()
    assert engine.batches == [["a"]]
