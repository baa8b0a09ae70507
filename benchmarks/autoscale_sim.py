"""The autoscaling recipe (deploy/kubernetes/autoscaling.yaml) against a bursty trace, beside fixed pools: a
deterministic simulation (docs/BENCHMARKS.md, "Autoscaling: the HPA recipe on a bursty trace").

The model, stated in full (every number a parameter; the defaults are assumptions, not measurements):
- the trace: a compressed day (one cycle over the run) whose rate swings between --low-rps and --high-rps,
  plus bursts (every --burst-every-s on average, exponential gaps) of --burst-factor times the rate for
  30 to 240 s; Poisson arrivals within each second; one image per request; seeded (--seed), so every run
  of the same arguments gives the same figures;
- a pod: one encoder taking up to --max-batch-size queued requests whenever it is free (the server's
  default policy: no batching wait), a forward of k requests costing --fixed-ms + k * --per-item-ms; the
  routers spread work perfectly (one queue for the pool: what routers reading /v1/load approach);
- a new pod serves --startup-s after the HPA asks for it (model load and warm-up), counted as provisioned
  meanwhile; a removed pod takes no new work at once and leaves when its batch ends (the drain);
- the HPA: every 15 s, the algorithm of Kubernetes' HorizontalPodAutoscaler v2 (tolerance 0.1, the
  stabilization windows, then the rate policies) with the targets, bounds, windows and policies read from
  deploy/kubernetes/autoscaling.yaml itself; its metrics as the prometheus-adapter rules compute them
  there: the busy fraction of the serving pods over the last 2 minutes, and the p99 queue wait of the last
  2 minutes (no scrape delay: Prometheus is taken as exact).

Reported per pool: the recipe's HPA; the same HPA on items per second (--items-target) instead of the busy
fraction; fixed at the replicas the trace's busiest minute needs at full batches and the busy-fraction
target; fixed at the mean's. For each: the replicas (min, time-weighted mean, max), the queue wait (p50,
p99, max) over every request, the encoder-seconds provisioned (starting and draining pods included), busy
and idle (provisioned less busy), and for the recipe's HPA the replicas every 10 minutes.

    python benchmarks/autoscale_sim.py [--hours 2] [--seed 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "deploy" / "kubernetes" / "autoscaling.yaml"
SYNC_S = 15.0  # the HPA controller's --horizontal-pod-autoscaler-sync-period
TOLERANCE = 0.1  # its --horizontal-pod-autoscaler-tolerance
WINDOW_S = 120.0  # the adapter rules' [2m]


def quantity(value) -> float:
    """A Kubernetes quantity as a number ("700m" is 0.7)."""
    text = str(value)
    return float(text[:-1]) / 1000.0 if text.endswith("m") else float(text)


@dataclass(frozen=True)
class Rule:
    """The HPA of the recipe: a target per metric (the adapter's names), bounds, windows and rate policies."""

    min_replicas: int
    max_replicas: int
    targets: tuple[tuple[str, float], ...]
    up_window_s: float
    down_window_s: float
    up_policies: tuple[tuple[str, int, float], ...]  # (type, value, periodSeconds)
    up_select: str
    down_policies: tuple[tuple[str, int, float], ...]
    down_select: str

    @classmethod
    def from_recipe(cls, path: Path = RECIPE) -> Rule:
        hpa = next(doc for doc in yaml.safe_load_all(path.read_text()) if doc["kind"] == "HorizontalPodAutoscaler")
        spec = hpa["spec"]
        targets = {metric["pods"]["metric"]["name"]: quantity(metric["pods"]["target"]["averageValue"])
                   for metric in spec["metrics"]}
        up, down = spec["behavior"]["scaleUp"], spec["behavior"]["scaleDown"]

        def policies(side: dict) -> tuple[tuple[str, int, float], ...]:
            return tuple((policy["type"], int(policy["value"]), float(policy["periodSeconds"]))
                         for policy in side["policies"])

        return cls(spec["minReplicas"], spec["maxReplicas"], tuple(targets.items()),
                   float(up["stabilizationWindowSeconds"]), float(down["stabilizationWindowSeconds"]), policies(up),
                   up.get("selectPolicy", "Max"), policies(down), down.get("selectPolicy", "Max"))


def proposal(current: int, value: float, target: float) -> int:
    """One metric's desired replicas, as the HPA computes it for an AverageValue target."""
    ratio = value / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return math.ceil(current * ratio)


@dataclass
class Autoscaler:
    """The HPA's decision every sync: proposals, the stabilization windows, then the rate policies."""

    rule: Rule
    recommendations: deque = field(default_factory=deque)  # (time, desired)
    changes: deque = field(default_factory=deque)  # (time, +added or -removed)

    def decide(self, now: float, current: int, values: dict[str, float]) -> int:
        """The replicas to have, given each metric's value (averaged over the pods, as the HPA reads it)."""
        rule = self.rule
        desired = max(proposal(current, values[name], target) for name, target in rule.targets)
        desired = min(rule.max_replicas, max(rule.min_replicas, desired))
        self.recommendations.append((now, desired))
        horizon = max(rule.up_window_s, rule.down_window_s)
        while self.recommendations and self.recommendations[0][0] < now - horizon:
            self.recommendations.popleft()
        up = min([desired] + [rec for at, rec in self.recommendations if at >= now - rule.up_window_s])
        down = max([desired] + [rec for at, rec in self.recommendations if at >= now - rule.down_window_s])
        target = current
        if target < up:
            target = up
        if target > down:
            target = down
        if target > current:
            target = min(target, self._limit(now, current, rule.up_policies, rule.up_select, up=True))
        elif target < current:
            target = max(target, self._limit(now, current, rule.down_policies, rule.down_select, up=False))
        if target != current:
            self.changes.append((now, target - current))
        return target

    def _limit(self, now: float, current: int, policies, select: str, up: bool) -> int:
        limits = []
        for kind, value, period in policies:
            moved = sum(change for at, change in self.changes if at > now - period and (change > 0) == up)
            start = current - moved  # the replicas at the start of the period
            if up:
                limits.append(start + value if kind == "Pods" else math.ceil(start * (1 + value / 100)))
            else:
                limits.append(start - value if kind == "Pods" else math.ceil(start * (1 - value / 100)))
        pick = max if (select == "Max") == up else min
        return pick(limits)


def trace(hours: float, low: float, high: float, burst_every_s: float, burst_factor: float,
          seed: int) -> np.ndarray:
    """Arrival times (seconds, sorted) of the bursty compressed day."""
    rng = np.random.default_rng(seed)
    seconds = int(hours * 3600)
    t = np.arange(seconds)
    rate = low + (high - low) * 0.5 * (1 - np.cos(2 * np.pi * t / seconds))
    at = rng.exponential(burst_every_s)
    while at < seconds:
        length = int(rng.uniform(30, 240))
        rate[int(at):int(at) + length] *= burst_factor
        at += length + rng.exponential(burst_every_s)
    counts = rng.poisson(rate)
    arrivals = np.repeat(t.astype(float), counts) + rng.random(int(counts.sum()))
    arrivals.sort()
    return arrivals


@dataclass
class Pod:
    ready_at: float
    born: float
    draining: bool = False
    busy_until: float = 0.0
    gone_at: float | None = None


def simulate(arrivals: np.ndarray, fixed_ms: float, per_item_ms: float, max_batch: int, startup_s: float,
             replicas: int | None = None, rule: Rule | None = None) -> dict:
    """Play `arrivals` against a fixed pool of `replicas`, or the HPA `rule` (starting at its minimum)."""
    fixed_s, per_item_s = fixed_ms / 1e3, per_item_ms / 1e3
    scaler = Autoscaler(rule) if rule is not None else None
    pods = [Pod(ready_at=0.0, born=0.0) for _ in range(replicas if rule is None else rule.min_replicas)]
    events: list[tuple[float, int, int]] = []  # (time, kind, pod index): kind 0 free, 1 ready, 2 sync
    idle: set[int] = set(range(len(pods)))
    head = 0  # arrivals[head:next_index] are queued
    waits = np.empty(len(arrivals))
    busy: deque[tuple[float, float, int]] = deque()  # (start, end, items) of forwards, for the 2-minute window
    dispatched: deque[tuple[float, np.ndarray]] = deque()  # (dispatch time, waits) for the 2-minute p99
    busy_total = 0.0
    timeline: list[tuple[float, int]] = [(0.0, len(pods))]
    if scaler is not None:
        heapq.heappush(events, (SYNC_S, 2, -1))
    end = float(arrivals[-1]) if len(arrivals) else 0.0

    def dispatch(index: int, now: float, queued_to: int) -> None:
        nonlocal head, busy_total
        count = min(max_batch, queued_to - head)
        waits[head:head + count] = now - arrivals[head:head + count]
        dispatched.append((now, waits[head:head + count]))
        head += count
        duration = fixed_s + per_item_s * count
        pods[index].busy_until = now + duration
        busy.append((now, now + duration, count))
        busy_total += duration
        idle.discard(index)
        heapq.heappush(events, (now + duration, 0, index))

    next_arrival = 0
    while next_arrival < len(arrivals) or events:
        arrival_t = arrivals[next_arrival] if next_arrival < len(arrivals) else math.inf
        event_t = events[0][0] if events else math.inf
        if arrival_t <= event_t:
            now = float(arrival_t)
            next_arrival += 1
            if idle:
                dispatch(min(idle), now, next_arrival)
            continue
        now, kind, index = heapq.heappop(events)
        if kind == 2:  # the HPA's sync
            if next_arrival >= len(arrivals) and head == len(arrivals):
                continue  # the trace is over and served: no more syncs
            heapq.heappush(events, (now + SYNC_S, 2, -1))
            while busy and busy[0][1] < now - WINDOW_S:
                busy.popleft()
            while dispatched and dispatched[0][0] < now - WINDOW_S:
                dispatched.popleft()
            live = [pod for pod in pods if pod.gone_at is None and not pod.draining]
            serving_s = sum(min(WINDOW_S, max(0.0, now - pod.ready_at)) for pod in live)
            window_busy = sum(min(stop, now) - max(start, now - WINDOW_S) for start, stop, _ in busy)
            window_items = sum(items for start, _, items in busy if start >= now - WINDOW_S)
            serving_pods = serving_s / WINDOW_S
            values = {  # each as its adapter rule computes it, averaged over the pods
                "encoder_busy_fraction_2m": window_busy / serving_s if serving_s > 0 else 0.0,
                "encoder_items_per_second_2m": window_items / WINDOW_S / serving_pods if serving_pods else 0.0,
                "encoder_queue_wait_p99_2m": float(np.percentile(np.concatenate([w for _, w in dispatched]), 99))
                if dispatched else 0.0,
            }
            target = scaler.decide(now, len(live), values)
            if target > len(live):
                for _ in range(target - len(live)):
                    pods.append(Pod(ready_at=now + startup_s, born=now))
                    heapq.heappush(events, (now + startup_s, 1, len(pods) - 1))
            elif target < len(live):
                for pod_index in sorted((i for i, pod in enumerate(pods) if pod in live), reverse=True)[
                        :len(live) - target]:  # the StatefulSet removes its newest pods first
                    pod = pods[pod_index]
                    pod.draining = True
                    if pod_index in idle or pod.ready_at > now:
                        idle.discard(pod_index)
                        pod.gone_at = now
            if target != len(live):
                timeline.append((now, target))
            continue
        pod = pods[index]
        if kind == 1:  # started: ready to serve, unless removed while starting
            if pod.gone_at is None:
                idle.add(index)
        elif pod.draining:  # its last batch ended: it leaves
            pod.gone_at = now
            continue
        else:
            idle.add(index)
        if index in idle and head < next_arrival:
            dispatch(index, now, next_arrival)

    finished = max([end] + [pod.busy_until for pod in pods])
    provisioned = sum((pod.gone_at if pod.gone_at is not None else finished) - pod.born for pod in pods)
    counts = [count for _, count in timeline]
    # The replicas' time-weighted mean over the trace.
    weighted = sum(count * ((timeline[i + 1][0] if i + 1 < len(timeline) else end) - at)
                   for i, (at, count) in enumerate(timeline))
    every_10_min = [[count for at, count in timeline if at <= minute * 60][-1]
                    for minute in range(0, int(end / 60) + 1, 10)]
    return {
        "served": int(head), "replicas_min": min(counts), "replicas_mean": round(weighted / end, 2) if end else 0,
        "replicas_max": max(counts),
        "wait_p50_ms": round(float(np.percentile(waits, 50)) * 1e3, 1),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 1),
        "wait_max_ms": round(float(waits.max()) * 1e3, 1),
        "provisioned_encoder_s": round(provisioned), "busy_encoder_s": round(busy_total),
        "idle_encoder_s": round(provisioned - busy_total), "replicas_every_10_min": every_10_min,
        "scale_outs": sum(1 for before, after in zip(counts, counts[1:]) if after > before),
        "scale_ins": sum(1 for before, after in zip(counts, counts[1:]) if after < before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=2.0, help="length of the trace (one compressed day)")
    parser.add_argument("--seed", type=int, default=7, help="the trace's random seed")
    parser.add_argument("--low-rps", type=float, default=20.0, help="the day's lowest rate, requests per second")
    parser.add_argument("--high-rps", type=float, default=160.0, help="the day's highest rate, before bursts")
    parser.add_argument("--burst-every-s", type=float, default=900.0, help="mean gap between bursts, seconds")
    parser.add_argument("--burst-factor", type=float, default=2.5, help="rate multiplier during a burst")
    parser.add_argument("--fixed-ms", type=float, default=20.0, help="fixed cost of one forward, ms")
    parser.add_argument("--per-item-ms", type=float, default=12.0, help="cost of each item in a forward, ms")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests per forward at most")
    parser.add_argument("--startup-s", type=float, default=90.0, help="seconds from scale-out to serving")
    parser.add_argument("--items-target", type=float, default=50.0,
                        help="items per second per pod: the target of the comparison rule (the recipe scales on the "
                             "busy fraction); 50 is 2/3 of the default pod's peak")
    parser.add_argument("--json", help="write the results as JSON to this file ('-': standard output only)")
    args = parser.parse_args()

    rule = Rule.from_recipe()
    targets = dict(rule.targets)
    arrivals = trace(args.hours, args.low_rps, args.high_rps, args.burst_every_s, args.burst_factor, args.seed)
    per_pod_rps = args.max_batch_size / ((args.fixed_ms + args.per_item_ms * args.max_batch_size) / 1e3)
    minute_rates = np.bincount((arrivals // 60).astype(int)) / 60.0
    # The fixed pools: what the busiest minute and the mean need at full batches, at the busy-fraction target.
    per_pod_target = per_pod_rps * targets["encoder_busy_fraction_2m"]
    peak_pods = math.ceil(minute_rates.max() / per_pod_target)
    mean_pods = math.ceil(minute_rates.mean() / per_pod_target)
    # The same rule on items per second instead of the busy fraction (not shipped: see the recipe's comments).
    on_items = dataclasses.replace(rule, targets=(("encoder_items_per_second_2m", args.items_target),
                                                  ("encoder_queue_wait_p99_2m", targets["encoder_queue_wait_p99_2m"])))
    costs = (args.fixed_ms, args.per_item_ms, args.max_batch_size, args.startup_s)
    results = [
        {"pool": "hpa", **simulate(arrivals, *costs, rule=rule)},
        {"pool": f"hpa on items/s ({args.items_target:g})", **simulate(arrivals, *costs, rule=on_items)},
        {"pool": "fixed at the peak", **simulate(arrivals, *costs, replicas=peak_pods)},
        {"pool": "fixed at the mean", **simulate(arrivals, *costs, replicas=mean_pods)},
    ]
    text = json.dumps(results, indent=1)
    if args.json == "-":
        print(text)
        return
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(f"{len(arrivals)} requests over {args.hours:g} h; a pod serves at most {per_pod_rps:.0f} req/s; "
          f"busiest minute {minute_rates.max():.0f} req/s, mean {minute_rates.mean():.0f} req/s", file=sys.stderr)
    print("| pool | replicas min / mean / max | queue wait p50 / p99 / max (ms) | encoder-s provisioned | busy "
          "| idle |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in results:
        print(f"| {row['pool']} | {row['replicas_min']} / {row['replicas_mean']} / {row['replicas_max']} | "
              f"{row['wait_p50_ms']} / {row['wait_p99_ms']} / {row['wait_max_ms']} | "
              f"{row['provisioned_encoder_s']} | {row['busy_encoder_s']} | {row['idle_encoder_s']} |")
    print(f"\nHPA replicas every 10 minutes: {' '.join(map(str, results[0]['replicas_every_10_min']))}")


if __name__ == "__main__":
    main()
