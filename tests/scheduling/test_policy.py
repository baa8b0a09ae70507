"""The dispatch policy (docs/CONTRACT.md, section 4) as pure functions: every rule, its edges, and properties.

Priorities, deadlines and promotions, adaptive waiting against a fixed cost model, and the
properties over a discrete-event simulation of the scheduler driving `decide`."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encode_server.scheduling.policy import (
    FUSABLE_MODALITIES,
    BatchPolicy,
    Dispatch,
    QueuedView,
    Sleep,
    adaptive_dispatch_time,
    deadline_margin,
    decide,
    form_batch,
    is_urgent,
    queue_key,
)

pytestmark = pytest.mark.quick


def queue(*arrivals: float, tokens: int = 4) -> list[QueuedView]:
    return [QueuedView(arrival=a, tokens=tokens) for a in arrivals]


def decide_one(modality: str, views: list[QueuedView], now: float, policy: BatchPolicy) -> Dispatch | Sleep:
    """`decide` with one modality queued."""
    return decide({modality: views}, now=now, policy=policy)


def batch_prefix(views: list[QueuedView], policy: BatchPolicy) -> tuple[int, bool]:
    """How many requests from the head `form_batch` takes with nobody urgent, and whether the batch is full."""
    positions, full = form_batch("image", views, -math.inf, policy, 0.0)
    assert positions == list(range(len(positions)))  # no promotion: the head of the order
    return len(positions), full


# --- rule 1: size trigger -------------------------------------------------------------------------

def test_full_batch_dispatches_at_once_even_before_max_wait():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=10.0, min_batch_size=4)
    assert decide_one("image", queue(0, 0, 0, 0, 0, 0), now=0.0, policy=policy) == Dispatch("image", 4)


def test_one_short_of_max_batch_waits_for_max_wait():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.5, min_batch_size=1)
    assert decide_one("image", queue(0, 0, 0), now=0.1, policy=policy) == Sleep(until=0.5)


# --- rule 2: max wait with min batch --------------------------------------------------------------

def test_after_max_wait_with_min_batch_dispatches_all():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1, min_batch_size=3)
    assert decide_one("image", queue(0, 0.05, 0.08), now=0.1, policy=policy) == Dispatch("image", 3)


def test_max_wait_is_measured_from_the_oldest_request():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1)
    assert decide_one("image", queue(1.0, 1.09), now=1.099, policy=policy) == Sleep(until=pytest.approx(1.1))
    assert decide_one("image", queue(1.0, 1.09), now=1.1, policy=policy) == Dispatch("image", 2)


def test_before_max_wait_with_min_batch_reached_still_waits():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.2, min_batch_size=2)
    assert decide_one("image", queue(0, 0, 0), now=0.1, policy=policy) == Sleep(until=0.2)


# --- rule 3: hard timeout -------------------------------------------------------------------------

def test_below_min_batch_keeps_waiting_until_hard_timeout():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1, min_batch_size=5, hard_timeout_additional_s=1.0)
    assert decide_one("image", queue(0, 0), now=0.5, policy=policy) == Sleep(until=pytest.approx(1.1))


def test_hard_timeout_dispatches_however_few():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1, min_batch_size=5, hard_timeout_additional_s=1.0)
    assert decide_one("image", queue(0, 0.9), now=1.1, policy=policy) == Dispatch("image", 2)


def test_zero_waits_dispatch_immediately():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.0, min_batch_size=1)
    assert decide_one("image", queue(5.0), now=5.0, policy=policy) == Dispatch("image", 1)


# --- the token cap --------------------------------------------------------------------------------

def test_token_cap_limits_the_prefix_and_counts_as_full():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=10.0, max_batch_tokens=10)
    views = [QueuedView(0, 4), QueuedView(0, 4), QueuedView(0, 4)]
    assert batch_prefix(views, policy) == (2, True)
    assert decide_one("audio", views, now=0.0, policy=policy) == Dispatch("audio", 2)


def test_token_cap_exact_fit_is_not_full_until_more_arrive():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=10.0, max_batch_tokens=8)
    assert batch_prefix([QueuedView(0, 4), QueuedView(0, 4)], policy) == (2, False)


def test_single_request_above_the_token_cap_runs_alone():
    policy = BatchPolicy(max_batch_size=32, max_batch_tokens=10)
    assert batch_prefix([QueuedView(0, 50), QueuedView(0, 1)], policy) == (1, True)
    assert decide_one("image", [QueuedView(0, 50)], now=0.0, policy=policy) == Dispatch("image", 1)


def test_no_token_cap_when_zero():
    policy = BatchPolicy(max_batch_size=3, max_batch_tokens=0)
    assert batch_prefix([QueuedView(0, 10**9)] * 5, policy) == (3, True)


# --- modalities, batching off, the empty queue ----------------------------------------------------

def test_video_goes_one_at_a_time():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=1.0, min_batch_size=8)
    assert decide_one("video", queue(0, 0, 0), now=0.0, policy=policy) == Dispatch("video", 1)
    assert "video" not in FUSABLE_MODALITIES and {"image", "audio"} <= FUSABLE_MODALITIES


def test_batching_off_is_one_request_per_forward_immediately():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=5.0, min_batch_size=8, dynamic_batching=False)
    assert decide_one("image", queue(0, 0, 0), now=0.0, policy=policy) == Dispatch("image", 1)


def test_empty_queue_sleeps_until_an_arrival():
    assert decide({}, now=0.0, policy=BatchPolicy()) == Sleep(until=None)
    assert decide({"image": []}, now=0.0, policy=BatchPolicy()) == Sleep(until=None)


def test_oldest_ready_modality_goes_first():
    policy = BatchPolicy(max_wait_s=0.0)
    queues = {"image": queue(2.0), "audio": queue(1.0)}
    assert decide(queues, now=3.0, policy=policy) == Dispatch("audio", 1)


def test_batching_off_is_fifo_across_modalities():
    policy = BatchPolicy(dynamic_batching=False)
    queues = {"image": queue(0.2, 0.3), "video": queue(0.1)}
    assert decide(queues, now=1.0, policy=policy) == Dispatch("video", 1)


def test_sleep_until_the_earliest_deadline_across_modalities():
    policy = BatchPolicy(max_wait_s=0.5, min_batch_size=1)
    queues = {"image": queue(1.0), "audio": queue(0.8)}
    assert decide(queues, now=0.9, policy=policy) == Sleep(until=pytest.approx(1.3))


# --- priorities and deadlines ---------------------------------------------------------------------

def ordered(*views: QueuedView) -> list[QueuedView]:
    """Views in the order the scheduler hands them over."""
    return sorted(views, key=queue_key)


def test_queue_order_is_priority_then_deadline_then_arrival():
    views = [QueuedView(0.0, 1), QueuedView(0.1, 1, priority=2), QueuedView(0.2, 1, priority=2, deadline=5.0),
             QueuedView(0.3, 1, priority=1, deadline=1.0), QueuedView(0.05, 1, priority=2)]
    assert [(v.priority, v.deadline, v.arrival) for v in ordered(*views)] == [
        (2, 5.0, 0.2), (2, math.inf, 0.05), (2, math.inf, 0.1), (1, 1.0, 0.3), (0, math.inf, 0.0)]


def test_a_full_batch_is_filled_from_the_head_of_the_priority_order():
    policy = BatchPolicy(max_batch_size=2)
    views = ordered(QueuedView(0.0, 1), QueuedView(0.1, 1), QueuedView(0.5, 1, priority=1))
    assert decide({"image": views}, now=0.5, policy=policy) == Dispatch("image", 2)
    assert views[0].priority == 1 and views[1].arrival == 0.0


def test_a_request_near_its_deadline_is_promoted_past_higher_priorities():
    policy = BatchPolicy(max_batch_size=2, deadline_margin_s=0.1)
    views = ordered(*[QueuedView(0.0, 1, priority=1) for _ in range(3)], QueuedView(0.0, 1, deadline=1.0))
    assert decide({"image": views}, now=0.8, policy=policy) == Dispatch("image", 2)  # not urgent yet
    promoted = decide({"image": views}, now=0.9, policy=policy)
    assert promoted == Dispatch("image", 2, positions=(3, 0))
    assert promoted.indices == (3, 0) and Dispatch("image", 2).indices == (0, 1)


def test_urgent_requests_go_earliest_deadline_first_across_levels():
    policy = BatchPolicy(max_batch_size=2, deadline_margin_s=1.0)
    views = ordered(QueuedView(0, 1, priority=2), QueuedView(0, 1, priority=1, deadline=1.5),
                    QueuedView(0, 1, priority=0, deadline=1.2), QueuedView(0, 1, priority=0, deadline=1.4))
    decision = decide({"image": views}, now=0.5, policy=policy)
    assert [views[i].deadline for i in decision.indices] == [1.2, 1.4]


def test_an_urgent_request_cuts_the_wait_short():
    policy = BatchPolicy(max_wait_s=5.0, min_batch_size=4, deadline_margin_s=0.2)
    views = [QueuedView(0.0, 1, deadline=2.0)]
    assert decide({"image": views}, now=1.0, policy=policy) == Sleep(until=pytest.approx(1.8))
    assert decide({"image": views}, now=1.8, policy=policy) == Dispatch("image", 1)


def test_the_urgent_modality_goes_first():
    policy = BatchPolicy(max_wait_s=0.0, deadline_margin_s=0.5)
    queues = {"image": [QueuedView(0.0, 1, priority=3)], "audio": [QueuedView(1.0, 1, deadline=1.2)]}
    assert decide(queues, now=1.0, policy=policy) == Dispatch("audio", 1)
    queues = {"image": [QueuedView(0.0, 1, priority=3)], "audio": [QueuedView(1.0, 1, deadline=9.0)]}
    assert decide(queues, now=1.0, policy=policy) == Dispatch("image", 1)


def test_higher_priority_modality_goes_first_then_fifo():
    policy = BatchPolicy(max_wait_s=0.0)
    queues = {"image": [QueuedView(0.0, 1)], "audio": [QueuedView(1.0, 1, priority=1)]}
    assert decide(queues, now=1.0, policy=policy) == Dispatch("audio", 1)


def test_video_takes_the_most_urgent_one_at_a_time():
    policy = BatchPolicy(deadline_margin_s=0.5)
    views = ordered(QueuedView(0.0, 1, priority=1), QueuedView(0.0, 1, deadline=1.0))
    assert decide({"video": views}, now=0.6, policy=policy) == Dispatch("video", 1, positions=(1,))
    assert decide({"video": views}, now=0.4, policy=policy) == Dispatch("video", 1)


def test_promotions_respect_the_token_cap_and_never_skip_ahead():
    policy = BatchPolicy(max_batch_size=8, max_batch_tokens=10, deadline_margin_s=1.0)
    views = ordered(QueuedView(0, 2, priority=1), QueuedView(0, 9, deadline=1.0), QueuedView(0, 1, deadline=1.1))
    positions, full = form_batch("image", views, 0.5, policy, 1.0)
    assert [views[i].tokens for i in positions] == [9, 1] and full  # the urgent two, then the cap


def test_the_margin_grows_with_the_learned_forward_time():
    policy = BatchPolicy(max_batch_size=8, deadline_margin_s=0.1)
    assert deadline_margin("image", policy) == 0.1
    costs = FixedCosts(fixed_s=0.01, per_request_s=0.005, rate=None)
    assert deadline_margin("image", policy, costs) == pytest.approx(0.1 + 2 * (0.01 + 0.04))


# --- adaptive waiting (--max-wait-ms auto) --------------------------------------------------------

@dataclass
class FixedCosts:
    """A cost model that has learned `fixed_s + per_request_s * k` and an arrival rate."""

    fixed_s: float
    per_request_s: float
    rate: float | None

    def curve(self, modality):
        return None if self.fixed_s is None else (self.fixed_s, self.per_request_s)

    def arrival_rate(self, modality, now):
        return self.rate


AUTO = BatchPolicy(max_batch_size=32, adaptive_wait=True, hard_timeout_additional_s=1.0, target_utilization=0.8,
                   max_wait_s=123.0, min_batch_size=30)  # the fixed knobs must not matter under auto


def test_auto_dispatches_at_once_until_the_curve_is_learned():
    assert decide({"image": queue(0.0)}, now=0.0, policy=AUTO) == Dispatch("image", 1)
    unknown = FixedCosts(fixed_s=None, per_request_s=0.0, rate=500.0)
    assert decide({"image": queue(0.0)}, now=0.0, policy=AUTO, costs=unknown) == Dispatch("image", 1)
    no_rate = FixedCosts(fixed_s=0.01, per_request_s=0.001, rate=None)
    assert decide({"image": queue(0.0)}, now=0.0, policy=AUTO, costs=no_rate) == Dispatch("image", 1)


def test_auto_dispatches_at_once_when_waiting_would_not_improve_throughput():
    # 10 req/s against a 11 ms forward: batches of one keep the encoder 11% busy.
    light = FixedCosts(fixed_s=0.010, per_request_s=0.001, rate=10.0)
    assert decide({"image": queue(0.0)}, now=0.0, policy=AUTO, costs=light) == Dispatch("image", 1)
    # no fixed cost: a fuller batch is not cheaper per request
    linear = FixedCosts(fixed_s=0.0, per_request_s=0.001, rate=5000.0)
    assert decide({"image": queue(0.0)}, now=0.0, policy=AUTO, costs=linear) == Dispatch("image", 1)


def test_auto_waits_for_the_batch_that_keeps_up_with_the_load():
    # 400 req/s, c(k) = 10 ms + 0.5 ms * k: k* = 400*0.010 / (0.8 - 400*0.0005) = 4 / 0.6 -> 7
    busy = FixedCosts(fixed_s=0.010, per_request_s=0.0005, rate=400.0)
    decision = decide({"image": queue(1.0, 1.001)}, now=1.002, policy=AUTO, costs=busy)
    assert decision == Sleep(until=pytest.approx(1.0 + 6 / 400.0))
    assert decide({"image": queue(*[1.0] * 7)}, now=1.002, policy=AUTO, costs=busy) == Dispatch("image", 7)
    assert decide({"image": queue(1.0, 1.001)}, now=1.015, policy=AUTO, costs=busy) == Dispatch("image", 2)
    assert adaptive_dispatch_time("image", 2, 1.0, AUTO, busy, 1.002) == pytest.approx(1.015)


def test_auto_waits_for_a_full_batch_when_no_batch_size_keeps_up():
    flooded = FixedCosts(fixed_s=0.010, per_request_s=0.004, rate=1000.0)  # 1000 * 4 ms = 4 > 0.8
    assert decide({"image": queue(0.0)}, now=0.0, policy=AUTO, costs=flooded) == Sleep(
        until=pytest.approx(31 / 1000.0))


def test_auto_never_waits_past_the_hard_timeout_nor_into_the_promotion_window():
    slow_arrivals = FixedCosts(fixed_s=0.5, per_request_s=0.0, rate=4.0)  # k* = 4*0.5/0.8 -> 3; 2 gaps of 250 ms
    capped = dataclasses.replace(AUTO, hard_timeout_additional_s=0.3, deadline_margin_s=0.0)
    assert decide({"image": queue(0.0)}, now=0.0, policy=capped, costs=slow_arrivals) == Sleep(until=0.3)
    views = [QueuedView(0.0, 1, deadline=5.0)]
    margin = deadline_margin("image", capped, slow_arrivals)  # 2 forwards of 0.5 s
    assert decide({"image": views}, now=0.0, policy=dataclasses.replace(capped, hard_timeout_additional_s=9.0),
                  costs=slow_arrivals) == Sleep(until=pytest.approx(0.5))
    assert margin == pytest.approx(1.0)
    assert decide({"image": views}, now=4.0, policy=capped, costs=slow_arrivals) == Dispatch("image", 1)


def test_auto_target_respects_the_token_cap():
    flooded = FixedCosts(fixed_s=0.010, per_request_s=0.004, rate=1000.0)
    policy = dataclasses.replace(AUTO, max_batch_tokens=20)
    # 5 tokens per request: at most 4 fit, and 4 are queued: dispatch
    assert decide({"image": queue(0, 0, 0, tokens=5)}, now=0.0, policy=policy, costs=flooded) == Sleep(
        until=pytest.approx(3 / 1000.0))
    assert adaptive_dispatch_time("image", 4, 0.0, policy, flooded, 0.0, tokens=20) is None


# --- properties, over a simulated encoder that is busy for random spans ---------------------------

policies = st.builds(
    BatchPolicy,
    max_batch_size=st.integers(1, 8),
    max_wait_s=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
    min_batch_size=st.integers(1, 6),
    hard_timeout_additional_s=st.sampled_from([0.0, 0.05, 0.3]),
    max_batch_tokens=st.sampled_from([0, 5, 12, 40]),
    dynamic_batching=st.booleans(),
    adaptive_wait=st.booleans(),
    deadline_margin_s=st.sampled_from([0.001, 0.05, 0.2]),  # 0 would leave no window before the deadline
)
fake_costs = st.one_of(st.none(), st.builds(
    FixedCosts, fixed_s=st.sampled_from([0.0, 0.005, 0.05]), per_request_s=st.sampled_from([0.0, 0.001, 0.02]),
    rate=st.sampled_from([None, 5.0, 100.0, 2000.0])))


@dataclass(frozen=True)
class Req:
    arrival: float
    modality: str
    tokens: int
    priority: int = 0
    timeout: float = math.inf


fifo_requests = st.lists(
    st.builds(Req, st.floats(0, 2.0, allow_nan=False), st.sampled_from(["image", "audio", "video"]),
              st.integers(1, 20)),
    min_size=1, max_size=40,
)
mixed_requests = st.lists(
    st.builds(Req, st.floats(0, 2.0, allow_nan=False), st.sampled_from(["image", "audio", "video"]),
              st.integers(1, 20), st.integers(0, 3), st.sampled_from([math.inf, 0.03, 0.1, 0.3, 1.0, 5.0])),
    min_size=1, max_size=40,
)


@dataclass
class Batch:
    at: float
    modality: str
    taken: list[tuple[int, QueuedView]]
    left: dict[str, list[QueuedView]]  # what stayed queued, per modality, at the dispatch
    full: bool


@dataclass
class SimLog:
    batches: list[Batch]
    expired: list[tuple[int, QueuedView]]
    idle_with_urgent: list[tuple[float, QueuedView]]  # the encoder free, the policy sleeping, an urgent request queued
    leftover: dict[str, list]


def simulate(policy: BatchPolicy, requests: list[Req], forward_s: float, costs=None) -> SimLog:
    """Drive `decide` the way the scheduler does: keep each modality's queue in `queue_key` order, drop
    requests at their deadline, consult the policy when the encoder is free, wake on the next arrival,
    the encoder finishing, or the policy's wake time. The encoder takes one batch at a time."""
    pending = sorted(enumerate(requests), key=lambda pair: pair[1].arrival)
    queues: dict[str, list[tuple[int, QueuedView]]] = {}
    log = SimLog([], [], [], queues)
    busy_until = 0.0
    events = [req.arrival for _, req in pending]
    heapq.heapify(events)
    steps = 0
    while events:
        steps += 1
        assert steps < 20_000, "the policy never dispatched: a request would hang"
        now = heapq.heappop(events)
        while pending and pending[0][1].arrival <= now:
            index, req = pending.pop(0)
            view = QueuedView(req.arrival, req.tokens, req.priority, req.arrival + req.timeout)
            bisect.insort(queues.setdefault(req.modality, []), (index, view), key=lambda pair: queue_key(pair[1]))
        for items in queues.values():
            log.expired += [(i, v) for i, v in items if v.deadline <= now]
            items[:] = [(i, v) for i, v in items if v.deadline > now]
        if now < busy_until:
            continue
        views = {m: [v for _, v in q] for m, q in queues.items() if q}
        decision = decide(views, now, policy, costs)
        if isinstance(decision, Dispatch):
            items = queues[decision.modality]
            assert len(set(decision.indices)) == decision.count == len(decision.indices)
            taken = [items[i] for i in decision.indices]
            for i in sorted(decision.indices, reverse=True):
                del items[i]
            _, full = form_batch(decision.modality, views[decision.modality], now, policy,
                                 deadline_margin(decision.modality, policy, costs))
            left = {m: [v for _, v in q] for m, q in queues.items()}
            log.batches.append(Batch(now, decision.modality, taken, left, full))
            busy_until = now + forward_s
            heapq.heappush(events, busy_until)
        else:
            for modality, queued in views.items():
                margin = deadline_margin(modality, policy, costs)
                log.idle_with_urgent += [(now, v) for v in queued if is_urgent(v, now, margin)]
            if decision.until is not None:
                assert decision.until > now - 1e-12, "asked to sleep until the past"
                heapq.heappush(events, max(decision.until, now))
    return log


PROPERTY = settings(max_examples=300, deadline=None)
forwards = st.sampled_from([0.0, 0.02, 0.1])


@PROPERTY
@given(policy=policies, requests=mixed_requests, forward_s=forwards, costs=fake_costs)
def test_every_request_is_dispatched_or_expires_exactly_once(policy, requests, forward_s, costs):
    log = simulate(policy, requests, forward_s, costs)
    dispatched = [index for batch in log.batches for index, _ in batch.taken]
    expired = [index for index, _ in log.expired]
    assert sorted(dispatched + expired) == list(range(len(requests)))
    assert not any(log.leftover.values())


@PROPERTY
@given(policy=policies, requests=mixed_requests, forward_s=forwards, costs=fake_costs)
def test_batches_respect_size_token_cap_and_one_modality(policy, requests, forward_s, costs):
    log = simulate(policy, requests, forward_s, costs)
    for batch in log.batches:
        assert 1 <= len(batch.taken) <= policy.max_batch_size
        assert {requests[index].modality for index, _ in batch.taken} == {batch.modality}
        if policy.max_batch_tokens and len(batch.taken) > 1:
            assert sum(view.tokens for _, view in batch.taken) <= policy.max_batch_tokens
        if batch.modality not in FUSABLE_MODALITIES or not policy.dynamic_batching:
            assert len(batch.taken) == 1


@PROPERTY
@given(policy=policies, requests=mixed_requests, costs=fake_costs)
def test_nothing_waits_past_its_limit_and_nothing_expires_while_the_encoder_is_free(policy, requests, costs):
    # With a forward that takes no time the encoder is always free, so any wait is the policy's:
    # at most max_wait + hard timeout (hard timeout alone under auto), and never past a deadline.
    log = simulate(policy, requests, forward_s=0.0, costs=costs)
    assert log.expired == []
    limit = (0.0 if policy.adaptive_wait else policy.max_wait_s) + policy.hard_timeout_additional_s + 1e-9
    for batch in log.batches:
        for _, view in batch.taken:
            assert batch.at - view.arrival <= limit
            assert batch.at < view.deadline


@PROPERTY
@given(policy=policies, requests=mixed_requests, forward_s=forwards, costs=fake_costs)
def test_no_lower_priority_request_leaves_before_a_higher_one_except_promotions(policy, requests, forward_s, costs):
    log = simulate(policy, requests, forward_s, costs)
    for batch in log.batches:
        margin = deadline_margin(batch.modality, policy, costs)
        for _, taken in batch.taken:
            for waiting in batch.left[batch.modality]:
                if is_urgent(taken, batch.at, margin):  # a promotion: earliest deadline first among the urgent
                    if is_urgent(waiting, batch.at, margin):
                        assert (taken.deadline, taken.arrival) <= (waiting.deadline, waiting.arrival)
                else:  # the head of the order: nothing left behind ranks before it, nothing urgent left behind
                    assert queue_key(taken) <= queue_key(waiting)
                    assert taken.priority >= waiting.priority
                    assert not is_urgent(waiting, batch.at, margin)


@PROPERTY
@given(policy=policies, requests=mixed_requests, forward_s=forwards, costs=fake_costs)
def test_no_request_expires_while_the_encoder_had_room_for_it(policy, requests, forward_s, costs):
    log = simulate(policy, requests, forward_s, costs)
    assert log.idle_with_urgent == [], "the encoder sat idle while a request neared its deadline"
    expired = {id(view): view for _, view in log.expired}
    for batch in log.batches:
        for modality, left in batch.left.items():
            margin = deadline_margin(modality, policy, costs)
            for view in left:
                if id(view) not in expired or not is_urgent(view, batch.at, margin):
                    continue
                # It was urgent, queued, and not taken: the batch had no room, being full of requests due
                # no later, or another modality's due earlier went first.
                head = batch.taken[0][1]
                assert is_urgent(head, batch.at, deadline_margin(batch.modality, policy, costs))
                assert head.deadline <= view.deadline
                if modality == batch.modality:
                    assert batch.full
                    assert all(is_urgent(t, batch.at, margin) for _, t in batch.taken)
                    assert all((t.deadline, t.arrival) <= (view.deadline, view.arrival) for _, t in batch.taken)


@settings(max_examples=200, deadline=None)
@given(policy=policies, requests=fifo_requests)
def test_without_priorities_or_deadlines_requests_of_one_modality_leave_in_arrival_order(policy, requests):
    log = simulate(policy, requests, forward_s=0.01)
    seen: dict[str, float] = {}
    for batch in log.batches:
        for _, view in batch.taken:
            assert view.arrival >= seen.get(batch.modality, float("-inf"))
            seen[batch.modality] = view.arrival


@settings(max_examples=200, deadline=None)
@given(policy=policies, requests=mixed_requests)
def test_batching_off_is_one_at_a_time_in_policy_order(policy, requests):
    policy = dataclasses.replace(policy, dynamic_batching=False)
    log = simulate(policy, requests, forward_s=0.01)
    for batch in log.batches:
        assert len(batch.taken) == 1


# --- the scenario the issue names: a flood with an interactive request on top, deadlines near their end ---

def flood(duration_s: float, every_s: float, priority: int) -> list[Req]:
    return [Req(round(i * every_s, 9), "image", 1, priority) for i in range(int(duration_s / every_s))]


def test_a_high_priority_flood_cannot_starve_a_low_priority_request_past_its_deadline():
    # 1000 high-priority req/s against 4 per 10 ms forward (400/s): the encoder is never idle.
    policy = BatchPolicy(max_batch_size=4, deadline_margin_s=0.1)
    low = Req(0.0005, "image", 1, priority=0, timeout=1.0)
    requests = [low] + flood(2.0, 0.001, priority=1)
    log = simulate(policy, requests, forward_s=0.01)
    served = {index: batch.at for batch in log.batches for index, _ in batch.taken}
    assert 0 in served and 0.9 <= served[0] < 1.0005  # promoted in its window, not earlier
    # without the promotion window it would have failed 504
    starved = simulate(dataclasses.replace(policy, deadline_margin_s=0.0), requests, forward_s=0.01)
    assert 0 in {index for index, _ in starved.expired}


def test_an_interactive_request_overtakes_a_queued_offline_flood():
    policy = BatchPolicy(max_batch_size=8)
    offline = flood(0.1, 0.0001, priority=0)  # 1000 requests queue up while the encoder is busy
    interactive = Req(0.05, "image", 1, priority=1, timeout=1.0)
    log = simulate(policy, offline + [interactive], forward_s=0.01)
    index = len(offline)
    first_after = next(batch for batch in log.batches if batch.at >= 0.05)
    assert index in {i for i, _ in first_after.taken}
    assert first_after.taken[0][0] == index  # at the head of the batch
    assert first_after.at - 0.05 <= 0.01 + 1e-9  # it waited for the running forward only
