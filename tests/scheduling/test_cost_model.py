"""The learned cost curve and arrival rates (`--max-wait-ms auto`), fed with synthetic observations."""

from __future__ import annotations

import random

import pytest

from encode_server.scheduling.cost_model import ArrivalRate, CostModel, EwStats, LinearCostFit
from encode_server.scheduling.policy import BatchPolicy, Dispatch, QueuedView, Sleep, decide

pytestmark = pytest.mark.quick


def feed(model: CostModel, fixed_s: float, per_token_s: float, tokens_per_request: int, batches: int,
         noise: float = 0.0, seed: int = 0, modality: str = "image") -> None:
    rng = random.Random(seed)
    for _ in range(batches):
        count = rng.randint(1, 32)
        tokens = count * tokens_per_request
        seconds = (fixed_s + per_token_s * tokens) * (1.0 + rng.uniform(-noise, noise))
        model.observe_batch(modality, count, tokens, seconds)


def test_ew_stats_match_plain_mean_and_variance_while_young():
    stats = EwStats(alpha=0.01)
    xs = [1.0, 2.0, 4.0, 7.0]
    for x in xs:
        stats.add(x, 2 * x)
    mean = sum(xs) / len(xs)
    assert stats.mean_x == pytest.approx(mean)
    assert stats.var_x == pytest.approx(sum((x - mean) ** 2 for x in xs) / len(xs))
    assert stats.cov_xy == pytest.approx(2 * stats.var_x)


def test_learns_an_exact_linear_curve():
    model = CostModel()
    feed(model, fixed_s=0.004, per_token_s=0.0001, tokens_per_request=4, batches=50)
    fixed_s, per_request_s = model.curve("image")
    assert fixed_s == pytest.approx(0.004)
    assert per_request_s == pytest.approx(0.0004)
    learned = model.summary(max_batch_size=4, now=0.0)["image"]
    assert learned["fixed_ms"] == pytest.approx(4.0) and learned["per_token_us"] == pytest.approx(100.0)
    assert learned["curve"][-1]["forward_ms"] == pytest.approx(4.0 + 0.4 * 4)


def test_learns_a_noisy_curve_within_tolerance():
    model = CostModel()
    feed(model, fixed_s=0.010, per_token_s=0.00005, tokens_per_request=64, batches=400, noise=0.1, seed=3)
    fixed_s, per_request_s = model.curve("image")
    assert fixed_s == pytest.approx(0.010, rel=0.25)
    assert per_request_s == pytest.approx(0.0032, rel=0.15)


def test_forgets_an_old_curve():
    model = CostModel(alpha=0.05)
    feed(model, fixed_s=0.050, per_token_s=0.001, tokens_per_request=4, batches=200)
    feed(model, fixed_s=0.002, per_token_s=0.0001, tokens_per_request=4, batches=200, seed=1)
    fixed_s, per_request_s = model.curve("image")
    assert fixed_s == pytest.approx(0.002, rel=0.05)
    assert per_request_s == pytest.approx(0.0004, rel=0.05)


def test_not_learned_until_enough_batches_of_different_sizes():
    model = CostModel(min_samples=8)
    assert model.curve("image") is None and model.arrival_rate("image", 0.0) is None
    for _ in range(100):
        model.observe_batch("image", 32, 128, 0.02)  # always full batches: fixed and per-token costs inseparable
    assert model.curve("image") is None
    model = CostModel(min_samples=8)
    feed(model, 0.004, 0.0001, 4, batches=7)
    assert model.curve("image") is None
    feed(model, 0.004, 0.0001, 4, batches=1, seed=9)
    assert model.curve("image") is not None
    assert model.curve("audio") is None  # per modality


def test_clamps_a_fit_that_makes_no_physical_sense():
    falling = LinearCostFit(min_samples=2)
    for tokens, seconds in [(10, 0.02), (20, 0.018), (30, 0.016)]:
        falling.observe(tokens, seconds)
    assert falling.coefficients() == (pytest.approx(0.018), 0.0)  # cost does not grow: all fixed
    below_zero = LinearCostFit(min_samples=2)
    for tokens, seconds in [(10, 0.001), (20, 0.005), (30, 0.009)]:
        below_zero.observe(tokens, seconds)
    fixed_s, per_token_s = below_zero.coefficients()
    assert fixed_s == 0.0 and per_token_s == pytest.approx(0.005 / 20)
    below_zero.observe(10, float("nan"))  # ignored
    assert below_zero.stats.count == 3


def test_arrival_rate_of_a_poisson_stream_and_its_fall_when_traffic_stops():
    rng = random.Random(7)
    rate, at = ArrivalRate(alpha=0.02), 0.0
    assert rate.rate(0.0) is None
    for _ in range(3000):
        at += rng.expovariate(200.0)
        rate.observe(at)
    assert rate.rate(at) == pytest.approx(200.0, rel=0.25)
    assert rate.rate(at + 0.1) == pytest.approx(10.0)  # 100 ms of silence: at most 10/s
    rate.observe(at - 1.0)  # a late report never moves time backwards
    assert rate.last == at


def test_summary_shows_the_learned_curve():
    model = CostModel()
    feed(model, fixed_s=0.004, per_token_s=0.0001, tokens_per_request=4, batches=50)
    for i in range(10):
        model.observe_arrival("image", i * 0.01)
    model.observe_arrival("audio", 0.0)
    summary = model.summary(max_batch_size=32, now=0.09)
    image = summary["image"]
    assert image["learned"] is True and image["batches_seen"] == 50
    assert image["fixed_ms"] == pytest.approx(4.0) and image["per_token_us"] == pytest.approx(100.0)
    assert image["mean_tokens_per_request"] == pytest.approx(4.0)
    assert image["arrival_rate_rps"] == pytest.approx(100.0)
    assert [row["batch_size"] for row in image["curve"]] == [1, 2, 4, 8, 16, 32]
    assert image["curve"][-1] == {"batch_size": 32, "forward_ms": pytest.approx(16.8),
                                  "ms_per_request": pytest.approx(16.8 / 32)}
    assert summary["audio"] == {"learned": False, "batches_seen": 0, "mean_tokens_per_request": 0.0,
                                "arrival_rate_rps": None}


def test_auto_decisions_from_a_learned_model():
    """The cost model and the policy together: a heavy fixed cost and a fast stream make it wait for
    company; a light stream makes it dispatch at once."""
    policy = BatchPolicy(max_batch_size=32, adaptive_wait=True, target_utilization=0.8)
    model = CostModel()
    feed(model, fixed_s=0.010, per_token_s=0.000125, tokens_per_request=4, batches=50)  # c(k) = 10 ms + 0.5 ms k
    for i in range(200):
        model.observe_arrival("image", i / 400.0)  # 400 req/s
    now = 199 / 400.0
    assert model.arrival_rate("image", now) == pytest.approx(400.0)
    one = [QueuedView(now, 4)]
    decision = decide({"image": one}, now, policy, model)
    assert decision == Sleep(until=pytest.approx(now + 6 / 400.0))  # k* = 400*0.01/(0.8-0.2) -> 7
    seven = [QueuedView(now, 4)] * 7
    assert decide({"image": seven}, now, policy, model) == Dispatch("image", 7)

    light = CostModel()
    feed(light, fixed_s=0.010, per_token_s=0.000125, tokens_per_request=4, batches=50)
    for i in range(20):
        light.observe_arrival("image", i / 10.0)  # 10 req/s
    assert decide({"image": [QueuedView(1.9, 4)]}, 1.9, policy, light) == Dispatch("image", 1)
