"""`SharedDemand`: a shared encode is ordered by its most demanding waiter and lives as long as its last."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from encode_server.scheduling.demand import Demand, SharedDemand, Urgency

pytestmark = pytest.mark.quick

demands = st.builds(Demand, deadline=st.floats(0, 100), priority=st.integers(-3, 3))


@given(st.lists(st.tuples(st.booleans(), demands), max_size=30))
def test_the_urgency_is_the_earliest_deadline_the_highest_priority_and_the_latest_deadline(steps):
    shared, held, heard = SharedDemand(), [], []
    shared.watch(heard.append)
    for leaving, demand in steps:
        if leaving and held:
            gone = held.pop(int(demand.deadline) % len(held))
            shared.leave(gone)
        else:
            held.append(demand)
            shared.join(demand)
        assert len(shared) == len(held)
        if held:
            expected = Urgency(min(d.deadline for d in held), max(d.priority for d in held),
                               max(d.deadline for d in held))
            assert shared.urgency == expected
            assert heard == [] or heard[-1] == expected  # the listener always holds the latest
        else:
            assert shared.urgency == Urgency(math.inf, 0, math.inf)


def test_the_listener_hears_changes_only():
    shared, heard = SharedDemand(), []
    shared.join(Demand(10.0, 0))
    shared.watch(heard.append)
    shared.join(Demand(20.0, 0))  # only the lifetime moves
    shared.join(Demand(15.0, 0))  # nothing moves
    shared.join(Demand(5.0, 1))
    shared.leave(Demand(15.0, 0))  # nothing moves
    shared.leave(Demand(5.0, 1))
    assert heard == [Urgency(10.0, 0, 20.0), Urgency(5.0, 1, 20.0), Urgency(10.0, 0, 20.0)]
    shared.watch(None)
    shared.join(Demand(1.0, 9))
    assert len(heard) == 3
