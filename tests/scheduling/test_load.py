"""The queue's load (`scheduling.load`, `EncoderScheduler.load`): depth, oldest wait, batches in flight and the
estimated wait of a newcomer from the learned forward cost, on synthetic costs and on the running scheduler
with a fake clock and a fake engine (docs/CONTRACT.md section 2, `/v1/load`)."""

from __future__ import annotations

import pytest

from encode_server.scheduling.cost_model import CostModel
from encode_server.scheduling.load import Running, queue_load
from encode_server.scheduling.policy import BatchPolicy, QueuedView
from tests.support.fakes import FakeEngine, SchedulerRig, job, settle

pytestmark = pytest.mark.quick

FIXED_S, PER_ROW_S = 0.010, 0.001


def learned_costs(modality: str = "image") -> CostModel:
    """A cost model that has learned `FIXED_S + PER_ROW_S * rows` exactly."""
    costs = CostModel()
    for size in (1, 2, 4, 8, 16, 3, 5, 7, 9, 11):
        costs.observe_batch(modality, size, 64 * size, FIXED_S + PER_ROW_S * 64 * size)
    return costs


def test_depth_rows_oldest_wait_and_the_work_ahead_from_the_learned_cost():
    views = [QueuedView(arrival=at, tokens=64) for at in (3.0, 1.0, 2.0)]  # policy order is not arrival order
    running = [Running("image", 128, dispatched_at=9.95)]
    load = queue_load({"image": views}, running, now=10.0, costs=learned_costs(), max_batch_size=32,
                      max_in_flight=2)
    image = load.modalities["image"]
    assert (image.queued, image.rows, image.oldest_wait_s) == (3, 192, 9.0)
    assert load.batches_in_flight == 1 and load.queued == 3
    queued_s = FIXED_S + PER_ROW_S * 192  # one forward of the three
    left_s = FIXED_S + PER_ROW_S * 128 - 0.05  # the running batch, 50 ms into its forward
    assert load.estimated_wait_s == pytest.approx(queued_s + left_s)
    halved = queue_load({"image": views}, running, 10.0, learned_costs(), 32, 2, lanes=2)
    assert halved.estimated_wait_s == pytest.approx((queued_s + left_s) / 2)
    # Past max_batch_size the queue takes several forwards, each paying the fixed cost.
    many = queue_load({"image": [QueuedView(arrival=0.0, tokens=64)] * 70}, (), 10.0, learned_costs(), 32, 2)
    assert many.estimated_wait_s == pytest.approx(3 * FIXED_S + PER_ROW_S * 64 * 70)


def test_the_estimate_is_zero_when_idle_and_unknown_for_a_modality_never_encoded():
    assert queue_load({}, (), 5.0, CostModel(), 32, 2).estimated_wait_s == 0.0
    unknown = queue_load({"audio": [QueuedView(arrival=4.0, tokens=10)]}, (), 5.0, learned_costs(), 32, 2)
    assert unknown.estimated_wait_s is None and unknown.modalities["audio"].oldest_wait_s == 1.0
    # Before the curve is learned (batches of one size only), the mean forward's cost per row stands in.
    young = CostModel()
    young.observe_batch("image", 1, 64, 0.032)
    assert queue_load({"image": [QueuedView(arrival=4.0, tokens=32)]}, (), 5.0, young, 32, 2).estimated_wait_s \
        == pytest.approx(0.016)


async def test_the_running_scheduler_reports_its_queue_on_a_fake_clock():
    rig = SchedulerRig(FakeEngine, max_in_flight=1)
    try:
        engine = FakeEngine(hold=True)
        scheduler, engine, clock = rig(BatchPolicy(), engine=engine)
        futures = [scheduler.submit(job("a"), deadline=clock.now() + 100)]  # dispatched at once, held
        await settle()
        futures.append(scheduler.submit(job("b"), deadline=clock.now() + 100))
        await clock.advance(0.5)
        futures.append(scheduler.submit(job("c"), deadline=clock.now() + 100))
        futures.append(scheduler.submit(job("v", modality="video"), deadline=clock.now() + 100))
        await clock.advance(0.25)
        load = scheduler.load()
        assert {modality: (entry.queued, entry.rows) for modality, entry in load.modalities.items()} == {
            "image": (2, 8), "video": (1, 4)}
        assert load.modalities["image"].oldest_wait_s == pytest.approx(0.75)
        assert load.modalities["video"].oldest_wait_s == pytest.approx(0.25)
        assert (load.batches_in_flight, load.max_in_flight) == (1, 1)
        assert load.estimated_wait_s is None  # nothing has finished a forward yet: no cost known
        engine.release()
        for future in futures:
            await future
        await settle()
        idle = scheduler.load()
        assert idle.modalities == {} and idle.batches_in_flight == 0 and idle.estimated_wait_s == 0.0
    finally:
        await rig.close()
