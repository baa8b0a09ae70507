"""Priorities through the service in-process: the `priority` field's validation, eviction at
`--max-pending`, metrics by priority, `--max-wait-ms auto` settings and the learned curve in
`/v1/performance`."""

from __future__ import annotations

import asyncio

import pytest

from encode_server.assembly import batch_policy
from encode_server.models import load_adapter
from encode_server.ops.settings import Settings, load_settings
from encode_server.records import EncodeError
from tests.support.fakes import until
from tests.support.service import HOLDING, body, started_service

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def adapter():
    return load_adapter("tiny-qwen2.5-vl", "cpu", "float32")


@pytest.fixture
async def holding(adapter):
    settings = Settings(**{**HOLDING.public_dict(), "api_key": None, "max_priority": 3})
    async with started_service(settings, adapter) as started:
        yield started


@pytest.mark.parametrize("priority, message", [
    (-1, "priority: Input should be greater than or equal to 0"), (4, "priority: must be at most 3"),
    ("1", "priority: Input should be a valid integer"), (1.5, "priority: Input should be a valid integer")])
async def test_a_bad_priority_is_400_naming_the_field(holding, priority, message):
    service, _ = holding
    with pytest.raises(EncodeError) as refused:
        await service.encode(body("bad", priority=priority))
    assert refused.value.status == 400 and message in refused.value.message


async def test_at_the_cap_a_higher_priority_request_evicts_the_newest_lowest_one(holding):
    service, clock = holding
    low = [asyncio.ensure_future(service.encode(body(f"low-{i}"))) for i in range(3)]
    await until(lambda: service.scheduler.queue_depth == 3)
    with pytest.raises(EncodeError) as refused:  # equal priority: refused itself
        await service.encode(body("low-3"))
    assert refused.value.status == 503
    urgent = asyncio.ensure_future(service.encode(body("interactive", priority=2)))
    await until(lambda: sum(task.done() for task in low) == 1)  # the newest queued low one is evicted
    evicted = next(task for task in low if task.done())
    assert isinstance(evicted.exception(), EncodeError)
    assert evicted.exception().status == 503 and evicted.exception().headers["Retry-After"] == "1"
    await until(lambda: service.scheduler.queue_depth == 3)
    await clock.advance(3.0)
    kept = [task for task in low if task is not evicted]
    served = await asyncio.gather(*kept, urgent)
    assert [response["req_id"] for response in served][-1] == "interactive" and len(served) == 3
    registry = service.metrics.registry
    assert registry.get_sample_value("encoder_evictions_total", {"modality": "image", "priority": "0"}) == 1.0
    assert registry.get_sample_value("encoder_request_duration_seconds_count",
                                     {"modality": "image", "priority": "2"}) == 1.0
    assert registry.get_sample_value("encoder_queue_wait_seconds_count", {"modality": "image", "priority": "0"}) == 2.0


async def test_performance_shows_the_cost_model(holding):
    service, _ = holding
    service.costs.observe_batch("image", 1, 4, 0.002)
    summary = await service.performance()
    assert summary["cost_model"]["image"]["learned"] is False
    assert summary["cost_model"]["image"]["batches_seen"] >= 1


def test_max_wait_auto_from_the_flag_and_the_environment():
    assert load_settings(["--max-wait-ms", "auto"], environ={}).adaptive_wait
    settings = load_settings([], environ={"ENCODER_MAX_WAIT_MS": "AUTO"})
    assert settings.max_wait_ms == "auto" and batch_policy(settings).adaptive_wait
    assert batch_policy(settings).max_wait_s == 0.0
    fixed = load_settings(["--max-wait-ms", "5"], environ={})
    assert fixed.max_wait_ms == 5.0 and not batch_policy(fixed).adaptive_wait
    assert batch_policy(fixed).max_wait_s == 0.005
    assert load_settings([], environ={"ENCODER_MAX_PRIORITY": "5"}).max_priority == 5
    for argv in (["--max-wait-ms", "soon"], ["--max-wait-ms", "-1"], ["--max-priority", "-1"]):
        with pytest.raises(SystemExit):
            load_settings(argv, environ={})
