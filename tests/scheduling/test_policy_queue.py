"""The scheduler's queues in policy order: insertion, batches taken by position, expiry, eviction."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encode_server.scheduling.policy import BatchPolicy, Dispatch, QueuedView, decide, queue_key
from encode_server.scheduling.queues import ModalityQueues, PolicyQueue

pytestmark = pytest.mark.quick


class Item:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def filled(*views: QueuedView) -> tuple[PolicyQueue, list[Item]]:
    queue: PolicyQueue = PolicyQueue()
    items = [Item(f"r{i}") for i in range(len(views))]
    for view, item in zip(views, items):
        queue.add(view, item)
    return queue, items


def test_items_come_out_in_policy_order_ties_first_added_first():
    queue, items = filled(QueuedView(0.0, 1), QueuedView(0.0, 1, priority=1), QueuedView(0.0, 1),
                          QueuedView(0.0, 1, priority=1, deadline=3.0))
    assert list(queue) == [items[3], items[1], items[0], items[2]]
    assert [view.priority for view in queue.views] == [1, 1, 0, 0]
    assert queue.views[1:3] == [queue.views[1], queue.views[2]]


def test_take_a_prefix_and_take_by_positions():
    queue, items = filled(*[QueuedView(float(i), 1) for i in range(5)])
    assert queue.take(Dispatch("image", 2)) == items[:2]
    assert queue.take(Dispatch("image", 2, positions=(2, 0))) == [items[4], items[2]]
    assert list(queue) == [items[3]]
    assert queue.discard(items[3]) and not queue.discard(items[3]) and len(queue) == 0


def test_expired_requests_are_popped_from_every_level():
    queue, items = filled(QueuedView(0, 1, priority=2, deadline=1.0), QueuedView(0, 1, priority=2, deadline=5.0),
                          QueuedView(0, 1, priority=1, deadline=0.5), QueuedView(0, 1, priority=1, deadline=0.9),
                          QueuedView(0, 1, priority=1), QueuedView(0, 1, deadline=1.0))
    assert queue.pop_expired(1.0) == [items[0], items[2], items[3], items[5]]
    assert list(queue) == [items[1], items[4]]
    assert queue.pop_expired(2.0) == []


def test_eviction_picks_the_request_served_last_below_the_newcomers_priority():
    queues: ModalityQueues = ModalityQueues()
    a, b, c, d = (Item(name) for name in "abcd")
    queues.add("image", QueuedView(0.0, 1, priority=1), a)
    queues.add("image", QueuedView(1.0, 1, priority=0, deadline=9.0), b)
    queues.add("audio", QueuedView(2.0, 1, priority=0, deadline=9.0), c)
    queues.add("audio", QueuedView(0.5, 1, priority=0, deadline=5.0), d)
    assert queues.eviction_candidate(priority=0) is None  # equal priority never evicts
    assert queues.eviction_candidate(priority=1) == ("audio", c)  # same deadline, newest
    assert queues.discard("audio", c)
    assert queues.eviction_candidate(priority=1) == ("image", b)
    assert queues.eviction_candidate(priority=2) == ("image", b)
    queues.discard("image", b)
    queues.discard("audio", d)
    assert queues.eviction_candidate(priority=2) == ("image", a)
    assert len(queues) == 1 and queues.clear() == [a] and len(queues) == 0


views = st.builds(QueuedView, st.floats(0, 10, allow_nan=False), st.integers(1, 9), st.integers(0, 3),
                  st.sampled_from([math.inf, 1.0, 2.0, 5.0]))


@settings(max_examples=200, deadline=None)
@given(st.lists(views, min_size=1, max_size=60), st.floats(0, 6, allow_nan=False))
def test_the_queue_agrees_with_a_sorted_list_and_decide_takes_what_it_names(given_views, now):
    queue, items = filled(*given_views)
    naive = sorted(zip(given_views, items, range(len(items))), key=lambda row: (*queue_key(row[0]), row[2]))
    assert list(queue) == [item for _, item, _ in naive]
    expired = queue.pop_expired(now)
    assert set(map(id, expired)) == {id(item) for view, item, _ in naive if view.deadline <= now}
    remaining = [(view, item) for view, item, _ in naive if view.deadline > now]
    assert list(queue) == [item for _, item in remaining]
    policy = BatchPolicy(max_batch_size=4, deadline_margin_s=1.0)
    if remaining:
        decision = decide({"image": queue.views}, max(now, max(view.arrival for view, _ in remaining)), policy)
        batch = queue.take(decision)
        assert batch == [remaining[i][1] for i in decision.indices]
        assert len(queue) == len(remaining) - len(batch)
