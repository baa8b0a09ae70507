"""The dispatch policy (docs/CONTRACT.md, section 4) as pure functions: every rule, its edges, and properties."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encode_server.policy import (
    FUSABLE_MODALITIES,
    BatchPolicy,
    Dispatch,
    QueuedView,
    Sleep,
    batch_prefix,
    decide,
    decide_modality,
)


def queue(*arrivals: float, tokens: int = 4) -> list[QueuedView]:
    return [QueuedView(arrival=a, tokens=tokens) for a in arrivals]


# --- rule 1: size trigger -------------------------------------------------------------------------

def test_full_batch_dispatches_at_once_even_before_max_wait():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=10.0, min_batch_size=4)
    assert decide_modality("image", queue(0, 0, 0, 0, 0, 0), now=0.0, policy=policy) == Dispatch("image", 4)


def test_one_short_of_max_batch_waits_for_max_wait():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0.5, min_batch_size=1)
    assert decide_modality("image", queue(0, 0, 0), now=0.1, policy=policy) == Sleep(until=0.5)


# --- rule 2: max wait with min batch --------------------------------------------------------------

def test_after_max_wait_with_min_batch_dispatches_all():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1, min_batch_size=3)
    assert decide_modality("image", queue(0, 0.05, 0.08), now=0.1, policy=policy) == Dispatch("image", 3)


def test_max_wait_is_measured_from_the_oldest_request():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1)
    assert decide_modality("image", queue(1.0, 1.09), now=1.099, policy=policy) == Sleep(until=pytest.approx(1.1))
    assert decide_modality("image", queue(1.0, 1.09), now=1.1, policy=policy) == Dispatch("image", 2)


def test_before_max_wait_with_min_batch_reached_still_waits():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.2, min_batch_size=2)
    assert decide_modality("image", queue(0, 0, 0), now=0.1, policy=policy) == Sleep(until=0.2)


# --- rule 3: hard timeout -------------------------------------------------------------------------

def test_below_min_batch_keeps_waiting_until_hard_timeout():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1, min_batch_size=5, hard_timeout_additional_s=1.0)
    assert decide_modality("image", queue(0, 0), now=0.5, policy=policy) == Sleep(until=pytest.approx(1.1))


def test_hard_timeout_dispatches_however_few():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.1, min_batch_size=5, hard_timeout_additional_s=1.0)
    assert decide_modality("image", queue(0, 0.9), now=1.1, policy=policy) == Dispatch("image", 2)


def test_zero_waits_dispatch_immediately():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=0.0, min_batch_size=1)
    assert decide_modality("image", queue(5.0), now=5.0, policy=policy) == Dispatch("image", 1)


# --- the token cap --------------------------------------------------------------------------------

def test_token_cap_limits_the_prefix_and_counts_as_full():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=10.0, max_batch_tokens=10)
    views = [QueuedView(0, 4), QueuedView(0, 4), QueuedView(0, 4)]
    assert batch_prefix(views, policy) == (2, True)
    assert decide_modality("audio", views, now=0.0, policy=policy) == Dispatch("audio", 2)


def test_token_cap_exact_fit_is_not_full_until_more_arrive():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=10.0, max_batch_tokens=8)
    assert batch_prefix([QueuedView(0, 4), QueuedView(0, 4)], policy) == (2, False)


def test_single_request_above_the_token_cap_runs_alone():
    policy = BatchPolicy(max_batch_size=32, max_batch_tokens=10)
    assert batch_prefix([QueuedView(0, 50), QueuedView(0, 1)], policy) == (1, True)
    assert decide_modality("image", [QueuedView(0, 50)], now=0.0, policy=policy) == Dispatch("image", 1)


def test_no_token_cap_when_zero():
    policy = BatchPolicy(max_batch_size=3, max_batch_tokens=0)
    assert batch_prefix([QueuedView(0, 10**9)] * 5, policy) == (3, True)


# --- modalities, batching off, the empty queue ----------------------------------------------------

def test_video_goes_one_at_a_time():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=1.0, min_batch_size=8)
    assert decide_modality("video", queue(0, 0, 0), now=0.0, policy=policy) == Dispatch("video", 1)
    assert "video" not in FUSABLE_MODALITIES and {"image", "audio"} <= FUSABLE_MODALITIES


def test_batching_off_is_one_request_per_forward_immediately():
    policy = BatchPolicy(max_batch_size=32, max_wait_s=5.0, min_batch_size=8, dynamic_batching=False)
    assert decide_modality("image", queue(0, 0, 0), now=0.0, policy=policy) == Dispatch("image", 1)


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


# --- properties, over a simulated encoder that is busy for random spans ---------------------------

policies = st.builds(
    BatchPolicy,
    max_batch_size=st.integers(1, 8),
    max_wait_s=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
    min_batch_size=st.integers(1, 6),
    hard_timeout_additional_s=st.sampled_from([0.0, 0.05, 0.3]),
    max_batch_tokens=st.sampled_from([0, 5, 12, 40]),
    dynamic_batching=st.booleans(),
)
arrivals = st.lists(
    st.tuples(st.floats(0, 2.0, allow_nan=False), st.sampled_from(["image", "audio", "video"]),
              st.integers(1, 20)),
    min_size=1, max_size=40,
)


def simulate(policy: BatchPolicy, requests, forward_s: float):
    """Drive `decide` the way the scheduler does: consult it when the encoder is free, wake on the
    next arrival, the encoder finishing, or the policy's deadline. Returns (batches, free-wait log)."""
    requests = sorted(enumerate(requests), key=lambda pair: pair[1][0])
    pending = list(requests)
    queues: dict[str, list[tuple[int, QueuedView]]] = {}
    batches, waits_while_free = [], []
    now, busy_until = 0.0, 0.0
    events: list[float] = []
    for _, (arrival, _, _) in pending:
        heapq.heappush(events, arrival)
    steps = 0
    while events:
        steps += 1
        assert steps < 10_000, "the policy never dispatched: a request would hang"
        now = heapq.heappop(events)
        while pending and pending[0][1][0] <= now:
            index, (arrival, modality, tokens) = pending.pop(0)
            queues.setdefault(modality, []).append((index, QueuedView(arrival, tokens)))
        if now < busy_until:
            continue
        views = {m: [v for _, v in q] for m, q in queues.items() if q}
        decision = decide(views, now, policy)
        if isinstance(decision, Dispatch):
            taken = queues[decision.modality][:decision.count]
            del queues[decision.modality][:decision.count]
            batches.append((now, decision.modality, taken))
            for _, view in taken:
                waits_while_free.append((now - view.arrival, view))
            busy_until = now + forward_s
            heapq.heappush(events, busy_until)
        elif decision.until is not None:
            assert decision.until > now - 1e-12, "asked to sleep until the past"
            heapq.heappush(events, max(decision.until, now))
    return batches, queues


@settings(max_examples=300, deadline=None)
@given(policy=policies, requests=arrivals, forward_s=st.sampled_from([0.0, 0.02, 0.1]))
def test_every_request_is_dispatched_exactly_once(policy, requests, forward_s):
    batches, leftover = simulate(policy, requests, forward_s)
    dispatched = [index for _, _, taken in batches for index, _ in taken]
    assert sorted(dispatched) == list(range(len(requests)))
    assert not any(leftover.values())


@settings(max_examples=300, deadline=None)
@given(policy=policies, requests=arrivals, forward_s=st.sampled_from([0.0, 0.02, 0.1]))
def test_batches_respect_size_token_cap_and_one_modality(policy, requests, forward_s):
    batches, _ = simulate(policy, requests, forward_s)
    for _, modality, taken in batches:
        assert 1 <= len(taken) <= policy.max_batch_size
        assert {requests[index][1] for index, _ in taken} == {modality}
        if policy.max_batch_tokens and len(taken) > 1:
            assert sum(view.tokens for _, view in taken) <= policy.max_batch_tokens
        if modality not in FUSABLE_MODALITIES or not policy.dynamic_batching:
            assert len(taken) == 1


@settings(max_examples=300, deadline=None)
@given(policy=policies, requests=arrivals)
def test_no_request_held_past_max_wait_plus_hard_timeout_while_the_encoder_is_free(policy, requests):
    # With a forward that takes no time the encoder is always free, so any wait is the policy's.
    batches, _ = simulate(policy, requests, forward_s=0.0)
    limit = policy.max_wait_s + policy.hard_timeout_additional_s + 1e-9
    for dispatched_at, _, taken in batches:
        for _, view in taken:
            assert dispatched_at - view.arrival <= limit


@settings(max_examples=200, deadline=None)
@given(policy=policies, requests=arrivals)
def test_requests_of_one_modality_leave_in_arrival_order(policy, requests):
    batches, _ = simulate(policy, requests, forward_s=0.01)
    seen: dict[str, float] = {}
    for _, modality, taken in batches:
        for _, view in taken:
            assert view.arrival >= seen.get(modality, float("-inf"))
            seen[modality] = view.arrival
