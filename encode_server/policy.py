"""The dispatch decision, as a pure function (docs/CONTRACT.md, section 4).

Given the queued requests of each modality (oldest first) and the current time, `decide` says
which requests form the next batch, or until when to sleep. It knows nothing of asyncio, clocks or
HTTP: the scheduler calls it only when the encoder can take a batch, with its own notion of `now`,
and applies the answer. That makes the rules testable exhaustively on their own.

Rules, per modality, with `n` queued and `w` the oldest one's wait:

1. `n >= max_batch_size` (or the token cap is already full): dispatch a full batch at once.
2. `w >= max_wait` and `n >= min_batch_size`: dispatch all of them (up to the caps).
3. `w >= max_wait + hard_timeout_additional`: dispatch all of them, however few.
4. Otherwise sleep until the earliest deadline, or until the next arrival when there is none.

A batch never exceeds `max_batch_size` requests nor `max_batch_tokens` tokens, except that a single
request larger than the token cap runs alone. Modalities that cannot be fused (video), and all
requests when dynamic batching is off, go one at a time, first in first out. When several
modalities are ready, the one whose oldest request is oldest goes first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Modalities whose requests may share one encoder forward.
FUSABLE_MODALITIES = frozenset({"image", "audio"})


@dataclass(frozen=True)
class QueuedView:
    """What the policy needs to know about one queued request."""

    arrival: float  # when it was queued, in the scheduler's clock (seconds)
    tokens: int  # encoder output tokens it will produce


@dataclass(frozen=True)
class BatchPolicy:
    """The batching knobs, in seconds and counts."""

    max_batch_size: int = 32
    max_wait_s: float = 0.0
    min_batch_size: int = 1
    hard_timeout_additional_s: float = 1.0
    max_batch_tokens: int = 0  # 0: no cap
    dynamic_batching: bool = True


@dataclass(frozen=True)
class Dispatch:
    """Take the first `count` queued requests of `modality` as one batch."""

    modality: str
    count: int


@dataclass(frozen=True)
class Sleep:
    """Nothing to dispatch now; wake at `until` (scheduler clock) or on the next arrival if None."""

    until: float | None


Decision = Dispatch | Sleep


def batch_prefix(queue: Sequence[QueuedView], policy: BatchPolicy) -> tuple[int, bool]:
    """How many of the oldest requests fit one batch, and whether that batch is full.

    Full means no later arrival could join it: it hit `max_batch_size`, or the next queued request
    would break the token cap. A first request larger than the token cap still forms a batch of one.
    """
    limit = min(len(queue), policy.max_batch_size)
    if policy.max_batch_tokens <= 0:
        return limit, limit >= policy.max_batch_size
    total = 0
    for index in range(limit):
        total += queue[index].tokens
        if total > policy.max_batch_tokens:
            count = max(index, 1)
            return count, True
    return limit, limit >= policy.max_batch_size


def decide_modality(modality: str, queue: Sequence[QueuedView], now: float, policy: BatchPolicy) -> Decision:
    """The decision for one modality's queue (oldest first)."""
    if not queue:
        return Sleep(until=None)
    if not policy.dynamic_batching or modality not in FUSABLE_MODALITIES:
        return Dispatch(modality, 1)
    count, full = batch_prefix(queue, policy)
    if full:
        return Dispatch(modality, count)
    oldest = queue[0].arrival
    wait_deadline = oldest + policy.max_wait_s
    hard_deadline = wait_deadline + policy.hard_timeout_additional_s
    if now >= wait_deadline and len(queue) >= policy.min_batch_size:
        return Dispatch(modality, count)
    if now >= hard_deadline:
        return Dispatch(modality, count)
    if len(queue) >= policy.min_batch_size:
        return Sleep(until=wait_deadline)
    return Sleep(until=hard_deadline)


def decide(queues: Mapping[str, Sequence[QueuedView]], now: float, policy: BatchPolicy) -> Decision:
    """The next batch across all modalities, or how long to sleep.

    Among modalities ready to dispatch, the one holding the oldest request wins (first in, first
    out across modalities). Otherwise sleep until the earliest of their deadlines.
    """
    ready: list[tuple[float, Dispatch]] = []
    wake: float | None = None
    for modality, queue in queues.items():
        decision = decide_modality(modality, queue, now, policy)
        if isinstance(decision, Dispatch):
            ready.append((queue[0].arrival, decision))
        elif decision.until is not None:
            wake = decision.until if wake is None else min(wake, decision.until)
    if ready:
        ready.sort(key=lambda pair: pair[0])
        return ready[0][1]
    return Sleep(until=wake)
