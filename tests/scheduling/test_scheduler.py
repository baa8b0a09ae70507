"""The scheduler in-process, on a fake clock and a fake engine: the dispatch rules of
docs/CONTRACT.md section 4 as the running scheduler applies them (max wait, min batch and hard
timeout, dropping the dead, the in-flight limit, probes), asserted without sleeping."""

from __future__ import annotations

import asyncio

import pytest

from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodeError, Timings
from encode_server.scheduling.policy import BatchPolicy
from encode_server.scheduling.scheduler import EncoderScheduler
from tests.support.fakes import FakeClock, FakeEngine, SchedulerRig, job, settle

pytestmark = pytest.mark.quick


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


class AheadEngine(FakeEngine):
    """A held `FakeEngine` that can prepare jobs ahead, as `EncoderEngine` with a pool: it records what it
    was asked to start, what it was told to forget, and which work ahead its batches used. Work ahead is
    ready at once, or (`instant=False`) when `finish(req_id)` says so, which calls its `on_done`."""

    def __init__(self, instant: bool = True) -> None:
        super().__init__(hold=True)
        self.instant = instant
        self.live: set[str] = set()  # jobs with work ahead not used nor forgotten
        self.ready: set[str] = set()
        self.on_done: dict[str, object] = {}
        self.started: list[str] = []
        self.forgotten: list[str] = []
        self.used: list[str] = []

    def prefetch(self, job, on_done=None) -> bool:
        assert job.req_id not in self.live, "started twice"
        self.live.add(job.req_id)
        self.started.append(job.req_id)
        self.on_done[job.req_id] = on_done
        if self.instant:
            self.ready.add(job.req_id)
        return True

    def finish(self, req_id: str) -> None:
        self.ready.add(req_id)
        self.on_done[req_id]()

    def prepared_ahead(self, job) -> bool:
        return job.req_id in self.live and job.req_id in self.ready

    def forget_prefetch(self, job) -> None:
        if job.req_id in self.live:
            self.live.discard(job.req_id)
            self.forgotten.append(job.req_id)

    async def encode(self, modality, jobs):
        for queued in jobs:
            if queued.req_id in self.live:
                self.live.discard(queued.req_id)
                self.used.append(queued.req_id)
        return await super().encode(modality, jobs)


async def test_queued_requests_are_prepared_ahead_in_policy_order_within_the_limit():
    engine, clock = AheadEngine(), FakeClock()
    scheduler = EncoderScheduler(engine, BatchPolicy(max_batch_size=2, max_wait_s=0), ServerMetrics(), clock=clock,
                                 max_in_flight=1, prefetch_limit=2)
    scheduler.start()
    try:
        now = clock.now()
        scheduler.submit(job("busy"), now + 60)
        await settle()
        futures = {name: scheduler.submit(job(name), now + deadline) for name, deadline in
                   (("a", 60), ("b", 5), ("c", 60), ("d", 60))}
        await settle()
        assert engine.batches == [["busy"]] and engine.started == ["b", "a"]  # b's deadline is earlier
        futures["urgent"] = scheduler.submit(job("urgent"), now + 60, priority=1)
        await settle()
        assert engine.started == ["b", "a"]  # at the limit: the newcomer waits, even first in line
        futures["a"].cancel()
        await settle()
        assert engine.forgotten == ["a"] and engine.started == ["b", "a", "urgent"]  # room again: the head
        await clock.advance(6)  # b times out in the queue (seen at the next wake-up: the next arrival)
        futures["e"] = scheduler.submit(job("e"), now + 60)
        await settle()
        assert engine.forgotten == ["a", "b"] and engine.started[-1] == "c"
        with pytest.raises(EncodeError) as expired:
            futures["b"].result()
        assert expired.value.status == 504
        engine.release()
        await settle()
        assert engine.batches == [["busy"], ["urgent", "c"], ["d", "e"]]
        assert engine.used == ["urgent", "c", "d", "e"] and engine.started == ["b", "a", "urgent", "c", "d", "e"]
        assert not engine.live  # everything started was used or given back
    finally:
        engine.release()
        await scheduler.stop()


async def test_a_batch_takes_the_requests_prepared_ahead_and_leaves_the_others_queued():
    engine, clock = AheadEngine(instant=False), FakeClock()
    scheduler = EncoderScheduler(engine, BatchPolicy(max_batch_size=4, max_wait_s=0), ServerMetrics(), clock=clock,
                                 max_in_flight=1, prefetch_limit=4)
    scheduler.start()
    try:
        now = clock.now()
        scheduler.submit(job("busy"), now + 60)  # an idle encoder takes it at once: nothing to prepare ahead
        await settle()
        futures = [scheduler.submit(job(f"r{i}"), now + 60 + i) for i in range(3)]
        await settle()
        assert engine.started == ["r0", "r1", "r2"] and engine.batches == [["busy"]]
        engine.release()  # from now on every batch ends at once
        await settle()
        assert engine.batches == [["busy"]]  # the encoder is free, but nothing is ready: nothing goes
        engine.finish("r1")  # its end wakes the scheduler (from the pool's thread in the server)
        await settle()
        assert engine.batches == [["busy"], ["r1"]]
        engine.finish("r0")
        engine.finish("r2")
        await settle()
        assert engine.batches == [["busy"], ["r1"], ["r0", "r2"]] and engine.used == ["r1", "r0", "r2"]
        assert all(future.done() and not future.exception() for future in futures)
    finally:
        engine.release()
        await scheduler.stop()


async def test_work_ahead_of_requests_failed_at_stop_is_given_back():
    engine, clock = AheadEngine(), FakeClock()
    scheduler = EncoderScheduler(engine, BatchPolicy(max_batch_size=4, max_wait_s=0), ServerMetrics(), clock=clock,
                                 max_in_flight=1, prefetch_limit=4)
    scheduler.start()
    scheduler.submit(job("busy"), clock.now() + 60)
    await settle()
    queued = [scheduler.submit(job(f"q{i}"), clock.now() + 60) for i in range(3)]
    await settle()
    assert engine.started == ["q0", "q1", "q2"]
    stopping = asyncio.ensure_future(scheduler.stop())  # the queued ones fail 503; the running batch finishes
    await settle()
    engine.release()
    await stopping
    assert all(isinstance(f.exception(), EncodeError) and f.exception().status == 503 for f in queued)
    assert sorted(engine.forgotten) == ["q0", "q1", "q2"] and not engine.live


def test_two_batches_in_flight_only_where_preparation_can_overlap_the_forward():
    from encode_server.scheduling.scheduler import batches_in_flight

    assert batches_in_flight(on_accelerator=False, forward_threads=1, cores=1) == 1  # one core, filled
    assert batches_in_flight(on_accelerator=False, forward_threads=1, cores=2) == 1  # the other is the loop's
    assert batches_in_flight(on_accelerator=False, forward_threads=8, cores=9) == 1
    assert batches_in_flight(on_accelerator=False, forward_threads=1, cores=3) == 2  # a core to prepare on
    assert batches_in_flight(on_accelerator=False, forward_threads=8, cores=16) == 2
    assert batches_in_flight(on_accelerator=True, forward_threads=1, cores=1) == 2  # a GPU's forward
    assert batches_in_flight(on_accelerator=False, forward_threads=1, cores=1, replicas=3) == 6


class CostlyEngine(FakeEngine):
    """Answers with the batch's given wall and CPU milliseconds of preparation and forward."""

    def __init__(self, wall: tuple[float, float], cpu: tuple[float, float]) -> None:
        super().__init__()
        self.wall, self.cpu = wall, cpu

    async def encode(self, modality, jobs):
        parts = await super().encode(modality, jobs)
        timings = Timings(preprocess=self.wall[0], encode=self.wall[1], prepare_cpu=self.cpu[0],
                          forward_cpu=self.cpu[1])
        return [part.with_timings(timings) for part in parts]


@pytest.mark.parametrize("wall, cpu, chosen", [
    ((10.2, 19.4), (3.95, 11.1), 1),  # 56x56 images with two in flight: a third of the wall time, a quarter of CPU
    ((120.0, 100.0), (64.7, 61.5), 2),  # camera images: half of either
    ((10.0, 20.0), (0.0, 0.0), 1),  # not measured (a pool, a replica): the count stands
])
async def test_the_overlap_follows_the_stages_cpu_time_not_their_wall_time(wall, cpu, chosen):
    from encode_server.scheduling.overlap import AdaptiveOverlap

    engine = CostlyEngine(wall, cpu)
    clock = FakeClock()
    scheduler = EncoderScheduler(engine, BatchPolicy(), ServerMetrics(), clock=clock, max_in_flight=1,
                                 overlap=AdaptiveOverlap(1, min_batches=1))
    scheduler.start()
    try:
        for index in range(3):
            await scheduler.submit(job(f"r{index}"), deadline=clock.now() + 10)
        assert scheduler.max_in_flight == chosen
        assert scheduler.overlap_info()["batches_in_flight"] == chosen
    finally:
        await scheduler.stop()
