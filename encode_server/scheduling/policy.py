"""The dispatch decision, as a pure function (docs/CONTRACT.md section 4, with priorities and deadlines).

Given the queued requests of each modality and the current time, `decide` says which requests form
the next batch, or until when to sleep. It knows nothing of asyncio, clocks or HTTP: the scheduler
calls it only when the encoder can take a batch, with its own notion of `now`, and applies the
answer. That makes the rules testable exhaustively on their own.

**The order.** The caller hands each modality's queue over already sorted by `queue_key`:
priority descending, then deadline ascending (earliest deadline first within a priority), then
arrival. With equal priorities and no deadlines that is first in, first out. A batch is filled from
the head of that order, except for promotions:

**Promotions.** A request is *urgent* once its deadline is within `deadline_margin` of now (the
configured floor plus, when the cost model has learned the curve, two full-batch forwards: the one
running and its own). Urgent requests of any priority go first, earliest deadline first, so a flood
of high-priority work cannot make a low-priority request fail 504 while the encoder had room for it.
Because each priority level is sorted by deadline, the urgent requests of a level are a prefix of it;
the policy finds the level boundaries by bisection, so a decision costs O(levels * log n + batch),
never a scan of the whole queue.

**The answer.** `Dispatch(modality, count, positions)`: take `count` requests; `positions` are their
indexes in the sequence the caller gave, in batch order, or None when they are simply the first
`count` (the common case: no promotion). The caller removes exactly those.

Rules, per modality, once the batch is formed (`n` queued, `w` the oldest one's wait):

1. The batch is full (`max_batch_size`, or the next request would break the token cap): dispatch.
2. Some queued request is urgent: dispatch at once, whatever the waits.
3. Fixed waiting: `w >= max_wait` and `n >= min_batch_size`: dispatch all of them (up to the caps);
   `w >= max_wait + hard_timeout_additional`: dispatch all of them, however few.
   Adaptive waiting (`adaptive_wait`, `--max-wait-ms auto`): see `adaptive_dispatch_time`.
4. Otherwise sleep until the earliest of those times (and of the next promotion), or until the next
   arrival when there is none.

A batch never exceeds `max_batch_size` requests nor `max_batch_tokens` tokens, except that a single
request larger than the token cap runs alone. Modalities that cannot be fused (video), and all
requests when dynamic batching is off, go one at a time, in the same order (first in first out when
priorities and deadlines are equal). When several modalities are ready, the one whose batch head
ranks first goes: an urgent head by its deadline, else the highest priority, earliest deadline,
oldest arrival.

When the batch is not full it holds the whole queue (fewer than `max_batch_size` requests), so the
wait rules look at all of it in O(batch).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from encode_server.ops.settings import DEFAULTS as SETTING_DEFAULTS

#: Modalities whose requests may share one encoder forward.
FUSABLE_MODALITIES = frozenset({"image", "audio"})

#: Forwards a dispatched batch may wait for: the one running, then its own (the scheduler keeps two in flight).
PIPELINE_DEPTH = 2


@dataclass(frozen=True)
class QueuedView:
    """What the policy needs to know about one queued request."""

    arrival: float  # when it was queued, in the scheduler's clock (seconds)
    tokens: int  # encoder output tokens it will produce
    priority: int = 0  # higher goes first
    deadline: float = math.inf  # when it fails 504, in the scheduler's clock
    expires: float | None = None  # if later than `deadline`: when it is dropped (a shared encode, see `demand`)

    @property
    def lifetime_end(self) -> float:
        """When it leaves the queue with 504: its deadline, or a later `expires`."""
        return self.deadline if self.expires is None else max(self.deadline, self.expires)


def queue_key(view: QueuedView) -> tuple[float, float, float]:
    """The order each modality's queue must be handed over in: priority desc, deadline asc, arrival asc."""
    return (-view.priority, view.deadline, view.arrival)


@dataclass(frozen=True)
class BatchPolicy:
    """The batching knobs, in seconds and counts (defaults: the settings table's; a server builds its
    policy from its settings with `assembly.batch_policy`)."""

    max_batch_size: int = SETTING_DEFAULTS["max_batch_size"]
    max_wait_s: float = SETTING_DEFAULTS["max_wait_ms"] / 1000.0
    min_batch_size: int = SETTING_DEFAULTS["min_batch_size"]
    hard_timeout_additional_s: float = SETTING_DEFAULTS["hard_timeout_additional_s"]
    max_batch_tokens: int = SETTING_DEFAULTS["max_batch_tokens"]  # 0: no cap
    dynamic_batching: bool = SETTING_DEFAULTS["enable_dynamic_batching"]
    adaptive_wait: bool = False  # --max-wait-ms auto: max_wait_s and min_batch_size are then not used
    deadline_margin_s: float = 0.1  # floor of the promotion window before a request's deadline
    target_utilization: float = 0.85  # adaptive waiting: keep the encoder at most this busy at the chosen batch size


class CostEstimates(Protocol):
    """What the policy reads from the learned cost model (`scheduling.cost_model.CostModel`); read only, no clock."""

    def curve(self, modality: str) -> tuple[float, float] | None:
        """(seconds per forward, seconds per typical request) of `modality`, or None until learned."""

    def arrival_rate(self, modality: str, now: float) -> float | None:
        """Requests per second of `modality` arriving lately, or None until known."""


@dataclass(frozen=True)
class Dispatch:
    """Take `count` queued requests of `modality` as one batch: those at `positions` (indexes into the
    sequence handed to `decide`, in batch order), or the first `count` when `positions` is None."""

    modality: str
    count: int
    positions: tuple[int, ...] | None = None

    @property
    def indices(self) -> tuple[int, ...]:
        return self.positions if self.positions is not None else tuple(range(self.count))


@dataclass(frozen=True)
class Sleep:
    """Nothing to dispatch now; wake at `until` (scheduler clock) or on the next arrival if None."""

    until: float | None


Decision = Dispatch | Sleep


def deadline_margin(modality: str, policy: BatchPolicy, costs: CostEstimates | None = None) -> float:
    """How long before its deadline a request becomes urgent: the floor, plus the expected service time
    (`PIPELINE_DEPTH` full-batch forwards) once the cost model knows it."""
    curve = costs.curve(modality) if costs is not None else None
    if curve is None:
        return policy.deadline_margin_s
    fixed_s, per_request_s = curve
    return policy.deadline_margin_s + PIPELINE_DEPTH * (fixed_s + per_request_s * policy.max_batch_size)


def is_urgent(view: QueuedView, now: float, margin_s: float) -> bool:
    """Whether `view` is promoted: its deadline is within the margin."""
    return view.deadline - margin_s <= now


def _batch_cap(modality: str, policy: BatchPolicy) -> int:
    if not policy.dynamic_batching or modality not in FUSABLE_MODALITIES:
        return 1
    return policy.max_batch_size


def _level_bounds(queue: Sequence[QueuedView]) -> list[tuple[int, int]]:
    """(start, end) of each run of equal priority, found by bisection (the queue is in `queue_key` order)."""
    bounds, start, size = [], 0, len(queue)
    while start < size:
        end = bisect_right(queue, -queue[start].priority, lo=start, key=lambda view: -view.priority)
        bounds.append((start, end))
        start = end
    return bounds


def _urgent_positions(queue: Sequence[QueuedView], now: float, margin_s: float, cap: int) -> list[int]:
    """The urgent requests (at most `cap` of each priority level), earliest deadline first."""
    urgent: list[int] = []
    for start, end in _level_bounds(queue):
        index = start
        while index < end and index - start < cap and is_urgent(queue[index], now, margin_s):
            urgent.append(index)
            index += 1
    urgent.sort(key=lambda index: (queue[index].deadline, queue[index].arrival, index))
    return urgent


def form_batch(modality: str, queue: Sequence[QueuedView], now: float, policy: BatchPolicy,
               margin_s: float) -> tuple[list[int], bool]:
    """The positions of the next batch in batch order, and whether it is full.

    Urgent requests first (earliest deadline first), then the head of the queue's order. Full means no
    later arrival could join it: it hit the size cap, or the next request in line would break the
    token cap (filling stops there: the order is never skipped). A first request larger than the token
    cap still forms a batch of one.
    """
    cap = _batch_cap(modality, policy)
    urgent = _urgent_positions(queue, now, margin_s, cap)
    taken = set(urgent)
    order = iter(urgent + [index for index in range(min(len(queue), cap + len(urgent))) if index not in taken])
    positions: list[int] = []
    total = 0
    for index in order:
        if len(positions) >= cap:
            break
        tokens = queue[index].tokens
        if policy.max_batch_tokens > 0 and positions and total + tokens > policy.max_batch_tokens:
            return positions, True
        positions.append(index)
        total += tokens
        if policy.max_batch_tokens > 0 and total > policy.max_batch_tokens:
            return positions, True  # a single request above the cap runs alone
    return positions, len(positions) >= cap


def adaptive_dispatch_time(modality: str, size: int, oldest: float, policy: BatchPolicy,
                           costs: CostEstimates | None, now: float, tokens: int = 0) -> float | None:
    """When to dispatch a batch of `size` requests under `--max-wait-ms auto`; None: at once.

    With the learned cost of a forward `c(k) = a + b*k` for `k` typical requests and the arrival rate
    `r`, batches of `k` keep up with the load at utilisation `r * c(k) / k`. The smallest batch that
    keeps the encoder at most `target_utilization` busy is `k* = r*a / (rho - r*b)` (every batch up to
    the cap when `r*b >= rho`: the load exceeds what any batch size sustains). If the queue already
    holds `k*`, waiting would not improve throughput: dispatch. Otherwise wait while a fuller batch is
    cheaper per request, until the expected time the `k*`-th request arrives counted from the oldest
    one (`oldest + (k* - 1) / r`), and never past `oldest + hard_timeout_additional_s`. Unknown cost or
    rate (a cold start, one batch size seen so far): dispatch at once, as `--max-wait-ms 0` does.
    The caller caps the time by the deadlines.
    """
    curve = costs.curve(modality) if costs is not None else None
    rate = costs.arrival_rate(modality, now) if costs is not None else None
    if curve is None or not rate or rate <= 0:
        return None
    fixed_s, per_request_s = curve
    if fixed_s <= 0:
        return None  # a forward costs the same per request at every size: nothing to gain by waiting
    cap = policy.max_batch_size
    if policy.max_batch_tokens > 0 and tokens > 0:
        cap = min(cap, max(1, int(policy.max_batch_tokens // (tokens / size))))
    rho = policy.target_utilization
    if rate * per_request_s >= rho:
        target = cap
    else:
        target = min(cap, math.ceil(rate * fixed_s / (rho - rate * per_request_s) - 1e-9))
    if size >= target:
        return None
    return min(oldest + (target - 1) / rate, oldest + policy.hard_timeout_additional_s)


@dataclass(frozen=True)
class _Plan:
    decision: Decision
    rank: tuple = ()  # how the batch's head ranks against other modalities' (lower goes first)


def _plan(modality: str, queue: Sequence[QueuedView], now: float, policy: BatchPolicy,
          costs: CostEstimates | None) -> _Plan:
    if not queue:
        return _Plan(Sleep(until=None))
    margin = deadline_margin(modality, policy, costs)
    positions, full = form_batch(modality, queue, now, policy, margin)
    head = queue[positions[0]]
    rank = (0, head.deadline, head.arrival) if is_urgent(head, now, margin) else (1, *queue_key(head))
    as_prefix = positions == list(range(len(positions)))
    dispatch = Dispatch(modality, len(positions), None if as_prefix else tuple(positions))
    if full:
        return _Plan(dispatch, rank)
    # Not full: the batch is the whole queue, fewer than max_batch_size requests.
    oldest = min(view.arrival for view in queue)
    promote_at = min(view.deadline for view in queue) - margin
    if now >= promote_at:
        return _Plan(dispatch, rank)
    if policy.adaptive_wait:
        until = adaptive_dispatch_time(modality, len(queue), oldest, policy, costs, now,
                                       sum(view.tokens for view in queue))
        if until is None or now >= until:
            return _Plan(dispatch, rank)
        return _Plan(Sleep(until=min(until, promote_at)))
    wait_deadline = oldest + policy.max_wait_s
    hard_deadline = wait_deadline + policy.hard_timeout_additional_s
    if now >= wait_deadline and len(queue) >= policy.min_batch_size:
        return _Plan(dispatch, rank)
    if now >= hard_deadline:
        return _Plan(dispatch, rank)
    until = wait_deadline if len(queue) >= policy.min_batch_size else hard_deadline
    return _Plan(Sleep(until=min(until, promote_at)))


def decide(queues: Mapping[str, Sequence[QueuedView]], now: float, policy: BatchPolicy,
           costs: CostEstimates | None = None) -> Decision:
    """The next batch across all modalities, or how long to sleep.

    Each queue must be in `queue_key` order. Among modalities ready to dispatch, the one whose batch
    head ranks first wins (an urgent head by deadline; else priority, deadline, arrival: first in,
    first out across modalities when those are equal). Otherwise sleep until the earliest wake time.
    """
    best: _Plan | None = None
    wake: float | None = None
    for modality, queue in queues.items():
        plan = _plan(modality, queue, now, policy, costs)
        if isinstance(plan.decision, Dispatch):
            if best is None or plan.rank < best.rank:
                best = plan
        elif plan.decision.until is not None:
            wake = plan.decision.until if wake is None else min(wake, plan.decision.until)
    if best is not None:
        return best.decision
    return Sleep(until=wake)
