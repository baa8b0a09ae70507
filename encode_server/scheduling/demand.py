"""What the requests waiting for one shared encode ask of the scheduler.

An encode started for the embedding cache's misses belongs to no single request: later requests for
the same items join it, and any of them may leave (cancelled, timed out) without failing the others.
The scheduler still has to order that encode by the requests behind it. `SharedDemand` keeps the
`Demand` (deadline, priority) of each waiting request and derives what the scheduler needs:

- its **urgency** from the most demanding waiter: the earliest deadline and the highest priority,
  which place it in the queue and promote it before that deadline;
- its **lifetime** from the longest: it expires (504 in the queue) only when no waiter could still
  use it, at the latest waiter's deadline.

A listener (the service, once the encode is queued) hears every change of those three values, so a
join by a more urgent request moves the queued encode forward, and the departure of the most urgent
waiter lets it fall back. Plain data, no asyncio: it lives on the loop of the cache that owns it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Demand:
    """One waiting request's claim: its deadline (the scheduler's clock) and its priority (higher first)."""

    deadline: float = math.inf
    priority: int = 0


@dataclass(frozen=True)
class Urgency:
    """What the scheduler is told of a shared encode: order by `deadline` and `priority`, drop at `expires`."""

    deadline: float
    priority: int
    expires: float


class SharedDemand:
    """The demands of the requests waiting for one shared encode (a multiset: two requests may ask alike)."""

    def __init__(self) -> None:
        self._demands: Counter[Demand] = Counter()
        self._listener: Callable[[Urgency], None] | None = None

    def __len__(self) -> int:
        return sum(self._demands.values())

    @property
    def urgency(self) -> Urgency:
        """Earliest deadline and highest priority of the waiters, and the latest deadline; with nobody
        waiting, no deadline and priority 0."""
        if not self._demands:
            return Urgency(math.inf, 0, math.inf)
        deadlines = [demand.deadline for demand in self._demands]
        return Urgency(min(deadlines), max(demand.priority for demand in self._demands), max(deadlines))

    def join(self, demand: Demand) -> None:
        """A request starts waiting."""
        before = self.urgency if self._listener is not None else None  # nobody to tell: skip the comparison
        self._demands[demand] += 1
        self._changed(before)

    def leave(self, demand: Demand) -> None:
        """A request stops waiting (it was answered, or gave up)."""
        before = self.urgency if self._listener is not None else None
        self._demands[demand] -= 1
        if self._demands[demand] <= 0:
            del self._demands[demand]
        if self._demands:  # the last one out cancels the encode: nothing left to re-rank
            self._changed(before)

    def watch(self, listener: Callable[[Urgency], None] | None) -> None:
        """Call `listener(urgency)` after every change of the urgency (None: stop)."""
        self._listener = listener

    def _changed(self, before: Urgency | None) -> None:
        if before is None or self._listener is None:
            return
        after = self.urgency
        if after != before:
            self._listener(after)
