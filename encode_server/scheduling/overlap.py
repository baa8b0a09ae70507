"""Whether the next batch is prepared during the forward: how many batches are in flight, from measured costs.

With two batches in flight, the engine prepares batch N+1 (the processor: resizing, patching, features) on its
own thread while batch N runs its forward, so preparation that takes a real share of a batch's time is hidden
behind the forward. Where the forward's threads leave no core for that preparation (a CPU forward on a small
machine), the overlap is paid for: the two contend for the cores, and a second batch in flight splits the queue,
so batches are smaller and an interactive request waits for two batches instead of one. Which effect wins
depends on the workload, not on core counts: 56x56 images prepare in a small fraction of their forward (one
batch in flight measured faster), camera-sized images spend most of their time being resized (the overlap
measured faster). So the choice follows the measured share of preparation in a batch's work, with a band
between the two thresholds so that it does not flap.

The work is measured as CPU time of the processor's thread and of the forward's, not as wall time: with two
batches in flight the two stages and the event loop contend for the cores, which stretches the preparation's
wall time (56x56 images on 2 cores: 34% of a batch's wall time with two in flight, against a small share of
its CPU), so a choice made from wall times kept two in flight where one was faster.

`choose_overlap` is the pure decision, tested on recorded costs; `AdaptiveOverlap` keeps the running means the
scheduler feeds it after every fused batch (no clock here: the caller passes every time in).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Overlap once preparing a batch takes at least this share of the batch's CPU time (preparation + forward) ...
#: (measured on 2 cores: camera images about half, 56x56 images about a quarter, where one batch was faster)
OVERLAP_FROM_SHARE = 0.40
#: ... and go back to one batch in flight once it falls below this one.
SERIAL_BELOW_SHARE = 0.30
#: Batches measured before the first choice: until then the count the service started with stands.
MIN_BATCHES = 4


@dataclass(frozen=True)
class OverlapChoice:
    """Batches in flight, and why (as `/server_info` shows it)."""

    in_flight: int
    reason: str


def choose_overlap(prepare_s: float, forward_s: float, current: int) -> OverlapChoice:
    """One batch in flight or two, from a batch's mean preparation and forward CPU seconds and the current count.

    Two once preparation is at least `OVERLAP_FROM_SHARE` of the batch's time; one once it is below
    `SERIAL_BELOW_SHARE`; in between, the current count stands."""
    total = prepare_s + forward_s
    share = prepare_s / total if total > 0 else 0.0
    overlap = share >= OVERLAP_FROM_SHARE or (current >= 2 and share >= SERIAL_BELOW_SHARE)
    said = (f"preparing a batch takes {share:.0%} of its CPU time ({prepare_s * 1e3:.1f} of {total * 1e3:.1f} ms "
            "in the processor's and the forward's threads)")
    if overlap:
        return OverlapChoice(2, f"{said}: the next batch is prepared during the forward")
    return OverlapChoice(1, f"{said}: one batch in flight, so that the queue is not split")


class AdaptiveOverlap:
    """Exponentially weighted means of a fused batch's preparation and forward CPU seconds, and the choice they
    give."""

    def __init__(self, initial: int, alpha: float = 0.2, min_batches: int = MIN_BATCHES) -> None:
        self.alpha = alpha
        self.min_batches = min_batches
        self.batches = 0
        self.prepare_s = 0.0
        self.forward_s = 0.0
        self.choice = OverlapChoice(initial, "not measured yet: the count the server started with")

    def observe(self, prepare_s: float, forward_s: float) -> OverlapChoice:
        """Take one fused batch's times; return the choice now in force."""
        if prepare_s < 0 or forward_s < 0:
            return self.choice
        self.batches += 1
        weight = max(self.alpha, 1.0 / self.batches)
        self.prepare_s += weight * (prepare_s - self.prepare_s)
        self.forward_s += weight * (forward_s - self.forward_s)
        if self.batches >= self.min_batches:
            self.choice = choose_overlap(self.prepare_s, self.forward_s, self.choice.in_flight)
        return self.choice

    def summary(self) -> dict[str, object]:
        """What `/server_info` shows: the choice, why, and the means it came from."""
        return {"adaptive": True, "batches_in_flight": self.choice.in_flight, "reason": self.choice.reason,
                "prepare_cpu_ms": round(self.prepare_s * 1e3, 3), "forward_cpu_ms": round(self.forward_s * 1e3, 3),
                "batches_measured": self.batches}
