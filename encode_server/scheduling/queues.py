"""The scheduler's queues, kept in the policy's order (`scheduling.policy.queue_key`), one per modality.

`PolicyQueue` holds the waiting requests of one modality sorted by priority (descending), deadline
and arrival, in a `sortedcontainers.SortedKeyList`: adding, removing one request, and reading the
i-th are O(log n). `decide` reads it through `views` (no copying) and the scheduler takes a batch
with `take(dispatch)` in O(batch * log n), promoted requests included. Expired requests are each
priority level's head (a level is sorted by deadline), so `pop_expired` finds them without a scan.

`ModalityQueues` is the set of them, plus the admission cap's eviction choice: the queued request
that the policy would serve last among those of strictly lower priority than a newcomer.

No asyncio and no clock here: the scheduler owns the queues and passes `now` in.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sortedcontainers import SortedKeyList

from encode_server.scheduling.policy import Dispatch, QueuedView, queue_key

T = TypeVar("T")


@dataclass(eq=False)
class _Entry(Generic[T]):
    key: tuple
    view: QueuedView
    item: T


class _Views(Sequence[QueuedView]):
    """The queue as the policy sees it: read-only `QueuedView`s in policy order, no copying."""

    def __init__(self, entries: SortedKeyList) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[QueuedView]:  # in one pass, not by index
        return (entry.view for entry in self._entries)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [entry.view for entry in self._entries[index]]
        return self._entries[index].view


class PolicyQueue(Generic[T]):
    """One modality's waiting requests, in `queue_key` order (ties: first added first)."""

    def __init__(self) -> None:
        self._entries: SortedKeyList = SortedKeyList(key=lambda entry: entry.key)
        self._sequence = itertools.count()
        self._by_item: dict[int, _Entry[T]] = {}
        self.views: Sequence[QueuedView] = _Views(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[T]:
        return (entry.item for entry in self._entries)

    def add(self, view: QueuedView, item: T) -> None:
        """Queue `item` (O(log n))."""
        entry = _Entry((*queue_key(view), next(self._sequence)), view, item)
        self._entries.add(entry)
        self._by_item[id(item)] = entry

    def discard(self, item: T) -> bool:
        """Remove `item` if it is queued (O(log n)); whether it was."""
        entry = self._by_item.pop(id(item), None)
        if entry is None:
            return False
        self._entries.remove(entry)
        return True

    def take(self, dispatch: Dispatch) -> list[T]:
        """Remove and return the dispatched requests, in batch order."""
        indices = dispatch.indices
        entries = [self._entries[index] for index in indices]
        if dispatch.positions is None:
            del self._entries[:dispatch.count]
        else:
            for index in sorted(indices, reverse=True):
                del self._entries[index]
        for entry in entries:
            del self._by_item[id(entry.item)]
        return [entry.item for entry in entries]

    def pop_expired(self, now: float) -> list[T]:
        """Remove and return the requests whose lifetime ended at or before `now`. Only the prefix of each
        priority level whose deadline has passed is looked at: a request outlives its deadline only when it
        `expires` later (a shared encode whose most urgent waiter left), and such a one is urgent anyway."""
        expired: list[T] = []
        index = 0
        while index < len(self._entries):
            entry = self._entries[index]
            if entry.view.deadline > now:  # the rest of this level is later still: on to the next level
                index = self._entries.bisect_key_right((-entry.view.priority, math.inf, math.inf, math.inf))
            elif entry.view.lifetime_end <= now:
                del self._entries[index]
                del self._by_item[id(entry.item)]
                expired.append(entry.item)
            else:
                index += 1
        return expired

    def last(self) -> tuple[QueuedView, T] | None:
        """The request the policy would serve last (lowest priority, latest deadline, newest)."""
        if not self._entries:
            return None
        entry = self._entries[-1]
        return entry.view, entry.item


@dataclass
class ModalityQueues(Generic[T]):
    """A `PolicyQueue` per modality, created on first use."""

    queues: dict[str, PolicyQueue[T]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self.queues.values())

    def add(self, modality: str, view: QueuedView, item: T) -> None:
        queue = self.queues.get(modality)
        if queue is None:
            queue = self.queues[modality] = PolicyQueue()
        queue.add(view, item)

    def views(self) -> Mapping[str, Sequence[QueuedView]]:
        """What `scheduling.policy.decide` reads: the non-empty queues."""
        return {modality: queue.views for modality, queue in self.queues.items() if len(queue)}

    def take(self, dispatch: Dispatch) -> list[T]:
        return self.queues[dispatch.modality].take(dispatch)

    def discard(self, modality: str, item: T) -> bool:
        queue = self.queues.get(modality)
        return queue is not None and queue.discard(item)

    def pop_expired(self, now: float) -> list[T]:
        return [item for queue in self.queues.values() for item in queue.pop_expired(now)]

    def eviction_candidate(self, priority: int) -> tuple[str, T] | None:
        """The queued request to evict so a newcomer of `priority` can be admitted: among those of strictly
        lower priority, the one the policy would serve last (lowest priority, then latest deadline and
        newest arrival); None when every queued request has at least that priority."""
        best: tuple[tuple, str, T] | None = None
        for modality, queue in self.queues.items():
            last = queue.last()
            if last is None or last[0].priority >= priority:
                continue
            view, item = last
            rank = (view.priority, -view.deadline, -view.arrival)
            if best is None or rank < best[0]:
                best = (rank, modality, item)
        return None if best is None else (best[1], best[2])

    def clear(self) -> list[T]:
        """Remove and return everything queued."""
        items = [item for queue in self.queues.values() for item in queue]
        self.queues.clear()
        return items
