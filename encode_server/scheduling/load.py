"""What the queue holds now and how long a newcomer would wait: the scheduler's part of the load report
(`/v1/load`, docs/CONTRACT.md section 2) and of the autoscaling gauges of `/metrics`.

`EncoderScheduler.load` takes it on the scheduler's loop (the one owner of the queue), in one pass over the
queued requests, when someone asks: nothing is kept up to date on the request path for it. `queue_load` is
the pure part (no clock, no asyncio): the queued requests and the batches in flight in, a `QueueLoad` out.

The estimated wait is the encoder time ahead of a request that arrives now: what is left of the batches in
flight plus the forwards the queued requests will take (every modality's: they share the encoder), from the
learned forward cost (`cost_model.CostModel.work_seconds`), divided among the data-parallel replicas. It
leaves out the batching wait the policy may add (`--max-wait-ms`) and a higher-priority request's jumping
the queue. None until the encoder has run a batch of each modality that is queued or in flight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from encode_server.ops.metrics import Signals
from encode_server.scheduling.cost_model import CostModel
from encode_server.scheduling.policy import QueuedView


@dataclass(frozen=True)
class ModalityLoad:
    """One modality's queue: request parts, their output rows, and how long the oldest has waited."""

    queued: int = 0
    rows: int = 0
    oldest_wait_s: float = 0.0

    def as_json(self) -> dict:
        return {"queued": self.queued, "rows": self.rows, "oldest_wait_s": round(self.oldest_wait_s, 6)}


@dataclass(frozen=True)
class QueueLoad:
    """The queue per modality, the batches between dispatch and the end of their forward, and the estimated
    wait of a request arriving now (None while the forward cost of what is ahead is unknown)."""

    modalities: Mapping[str, ModalityLoad]
    batches_in_flight: int
    max_in_flight: int
    estimated_wait_s: float | None

    @property
    def queued(self) -> int:
        return sum(load.queued for load in self.modalities.values())


@dataclass(frozen=True)
class Running:
    """A batch between dispatch and the end of its forward."""

    modality: str
    rows: int
    dispatched_at: float


def queue_load(queues: Mapping[str, Iterable[QueuedView]], running: Iterable[Running], now: float,
               costs: CostModel, max_batch_size: int, max_in_flight: int, lanes: int = 1) -> QueueLoad:
    """The load of `queues` (each modality's queued requests) and the `running` batches at `now`; `lanes`: the
    forwards that run side by side (the data-parallel replicas)."""
    modalities: dict[str, ModalityLoad] = {}
    ahead: float | None = 0.0
    for modality, views in queues.items():
        count = rows = 0
        oldest = now
        for view in views:
            count += 1
            rows += view.tokens
            if view.arrival < oldest:
                oldest = view.arrival
        if not count:
            continue
        modalities[modality] = ModalityLoad(count, rows, now - oldest)
        work = costs.work_seconds(modality, rows, math.ceil(count / max(1, max_batch_size)))
        ahead = None if work is None or ahead is None else ahead + work
    batches = list(running)
    if batches and ahead is not None:
        left = 0.0
        for batch in batches:
            work = costs.work_seconds(batch.modality, batch.rows)
            if work is None:
                ahead = None
                break
            left += work
        else:  # the first dispatched has been running since then: that much of the total is done
            ahead += max(0.0, left - (now - min(batch.dispatched_at for batch in batches)))
    estimated = None if ahead is None else ahead / max(1, lanes)
    return QueueLoad(modalities, len(batches), max_in_flight, estimated)


@dataclass(frozen=True)
class LoadReport:
    """`GET /v1/load` (docs/CONTRACT.md section 2): what a router needs to pick an encoder, polled every second.
    `EncoderService.load_report` builds it; any front (HTTP, gRPC) serves the same record."""

    draining: bool
    pending: int  # admitted and not answered yet
    queue: QueueLoad
    signals: Signals

    def as_json(self) -> dict:
        queue, signals = self.queue, self.signals
        return {
            "draining": self.draining,
            "pending": self.pending,
            "queued": queue.queued,
            "modalities": {modality: load.as_json() for modality, load in queue.modalities.items()},
            "batches_in_flight": queue.batches_in_flight,
            "batches_in_flight_max": queue.max_in_flight,
            "estimated_wait_s": None if queue.estimated_wait_s is None else round(queue.estimated_wait_s, 6),
            "cache_hit_rate": signals.as_json()["cache_hit_rate"],
            "last_minute": {key: value for key, value in signals.as_json().items() if key != "cache_hit_rate"},
        }
