"""Prometheus metrics and the 60-second `/v1/performance` window.

`ServerMetrics` owns one registry per server (so several servers can live in one test process);
the scheduler, engine and HTTP layer record into it exactly where decisions are made. Labelled
series for the model's modalities exist from start-up (at 0), so a dashboard shows 0, not "no data".

The autoscaling signals (docs/OPERATIONS.md, "Autoscaling") are read when asked, not kept up to date per
request: the forward's busy seconds, items and rows are running totals the engine adds to once per batch;
`SignalWindow` turns them into rates over the last minute when read; the queue's state is taken on the
scheduler's loop just before a scrape or a load report (`LoadCollector` exports the last one taken).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# `*_created` series only add noise to dashboards.
disable_created_metrics()

# Encoders answer in milliseconds; the default Prometheus buckets start at 5 ms.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 180.0)
#: Event-loop lag: the goal is under 5 ms at p99.
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
#: The `status` values `encoder_requests_total` takes, created at 0 for every modality at start-up.
KNOWN_STATUSES = ("200", "400", "409", "500", "502", "503", "504", "cancelled")
#: The `front` values of `encoder_front_requests_total`: the door a request came in by (`/encode` over HTTP, SGLang's
#: gRPC encoder service, vLLM's chat route).
FRONTS = ("http", "grpc", "vllm")
#: The `stage` values of `encoder_preprocess_seconds`.
PREPROCESS_STAGES = ("read", "decode", "processor")


class PerformanceWindow:
    """Finished requests of the last `window_s` seconds, summarised for `/v1/performance`.

    `throughput_rps` is the requests finished in the window divided by the time the window covers:
    `window_s`, or less while the window is younger than that (since it was created, at start-up).
    One request a second after start-up reads as 1 rps, not as 1 over its own latency.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        # (finished at, latency_s, batch_size, items, cached_items) per request; batch_size 0: every item came from
        # the embedding cache. Plain tuples of numbers, which the garbage collector stops tracking: a minute of
        # requests at a thousand a second would otherwise be 60,000 objects in each of its passes.
        self._finished: deque[tuple[float, float, int, int, int]] = deque()

    def record(self, latency_s: float, batch_size: int, items: int = 0, cached_items: int = 0) -> None:
        self._finished.append((self._clock(), latency_s, batch_size, items, cached_items))
        self._prune()

    def _prune(self) -> None:
        horizon = self._clock() - self.window_s
        while self._finished and self._finished[0][0] < horizon:
            self._finished.popleft()

    def summary(self, max_batch_size: int, queue_depth: int) -> dict:
        self._prune()
        finished = list(self._finished)
        count = len(finished)
        latencies = sorted(latency_s * 1000.0 for _, latency_s, _, _, _ in finished)

        def percentile(q: float) -> float:
            if not latencies:
                return 0.0
            return latencies[min(len(latencies) - 1, int(q * len(latencies)))]

        forwarded = [batch_size for _, _, batch_size, _, _ in finished if batch_size > 0]
        avg_batch = sum(forwarded) / len(forwarded) if forwarded else 0.0
        items = sum(entry[3] for entry in finished)
        covered_s = min(self.window_s, self._clock() - self._started)
        return {
            "window_s": self.window_s,
            "covered_s": covered_s,
            "requests": count,
            "throughput_rps": count / covered_s if count and covered_s > 0 else 0.0,
            "latency_ms": {
                "avg": sum(latencies) / count if count else 0.0,
                "p50": percentile(0.50),
                "p99": percentile(0.99),
            },
            "avg_batch_size": avg_batch,
            "batching_efficiency": avg_batch / max_batch_size if max_batch_size else 0.0,
            "queue_depth": queue_depth,
            "cache_hit_rate": sum(entry[4] for entry in finished) / items if items else 0.0,
        }


class SignalWindow:
    """Rates over about the last `window_s` seconds of running totals, sampled only when read (no timer, nothing
    on the request path).

    Each read keeps a sample of the totals (at most one per `step_s`) and answers the change since the newest
    sample at least `window_s` old: so the window spans `window_s` plus at most the gap between two reads (a
    scraper every 15 s, a router every second), or everything since start-up while the server is younger.
    """

    def __init__(self, size: int, window_s: float = 60.0, step_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.step_s = step_s
        self._clock = clock
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque([(clock(), (0.0,) * size)])

    def change(self, totals: tuple[float, ...]) -> tuple[float, tuple[float, ...]]:
        """(seconds covered, each total's change over them), given the totals now."""
        now = self._clock()
        samples = self._samples
        if now - samples[-1][0] >= self.step_s:
            samples.append((now, totals))
        while len(samples) > 1 and samples[1][0] <= now - self.window_s:
            samples.popleft()
        since, base = samples[0]
        return now - since, tuple(total - old for total, old in zip(totals, base))


def quantile_of_buckets(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float:
    """The `q` quantile of a histogram's cumulative bucket counts (upper `bounds`, the last +Inf), interpolated
    within the bucket as Prometheus's `histogram_quantile` does; 0 for an empty histogram."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    below, lower = 0.0, 0.0
    for bound, count in zip(bounds, cumulative):
        if count >= rank:
            if bound == float("inf"):
                return lower  # past the last finite bound: the highest one known
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        below, lower = count, bound
    return lower


@dataclass(frozen=True)
class Signals:
    """What the autoscaling gauges and the load report say over the last window (`SignalWindow`)."""

    window_s: float  # the seconds the figures cover
    busy_fraction: float  # the share of that time a forward ran (per data-parallel replica)
    items_per_s: float
    rows_per_s: float
    queue_wait_p99_s: float
    cache_hit_rate: float | None  # None: the cache is off, or nothing was looked up in the window

    def as_json(self) -> dict:
        return {"window_s": round(self.window_s, 3), "busy_fraction": round(self.busy_fraction, 4),
                "items_per_s": round(self.items_per_s, 3), "rows_per_s": round(self.rows_per_s, 3),
                "queue_wait_p99_s": round(self.queue_wait_p99_s, 6),
                "cache_hit_rate": None if self.cache_hit_rate is None else round(self.cache_hit_rate, 4)}


class LoopLagMonitor:
    """How late the event loop runs a timer, the usual sign of a blocked loop: a timer every
    `interval_s` (0.1 s: ten callbacks a second cost nothing), each one's lateness set on `gauge` and,
    when given, observed by `histogram`, so percentiles over a burst can be read from /metrics.

    With `cpu`, each tick also adds the CPU time its thread used since the last tick: the thread
    running the loop, so the counter's rate is how busy the loop is. Lag with the loop's thread near
    one core means a loop with more work than it can do (scale out); lag with the thread idle means
    the thread waits (for the GIL, or in a blocking call)."""

    def __init__(self, gauge: Gauge, interval_s: float = 0.1, histogram: Histogram | None = None,
                 cpu: Counter | None = None) -> None:
        self._gauge = gauge
        self._histogram = histogram
        self._cpu = cpu
        self._cpu_seen = 0.0
        self.interval_s = interval_s
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._cpu_seen = time.thread_time()
        expected = loop.time() + self.interval_s
        self._handle = loop.call_at(expected, self._tick, loop, expected)

    def _tick(self, loop: asyncio.AbstractEventLoop, expected: float) -> None:
        lag = max(0.0, loop.time() - expected)
        self._gauge.set(lag)
        if self._histogram is not None:
            self._histogram.observe(lag)
        if self._cpu is not None:
            cpu, self._cpu_seen = self._cpu_seen, time.thread_time()
            self._cpu.inc(max(0.0, self._cpu_seen - cpu))
        expected = loop.time() + self.interval_s
        self._handle = loop.call_at(expected, self._tick, loop, expected)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


class ServerMetrics:
    """Every metric the server exports, in its own registry.

    `modalities` are the model's: their labelled series are created at 0 right away. `clock` times the
    autoscaling window (`SignalWindow`).
    """

    def __init__(self, modalities: Sequence[str] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        self.requests_total = Counter(
            "encoder_requests_total", "Finished /encode requests by modality and outcome",
            ["modality", "status"], registry=r)
        self.front_requests = Counter(
            "encoder_front_requests_total", "Finished encode requests by the front that answered them and outcome",
            ["front", "status"], registry=r)
        self.batch_size = Histogram(
            "encoder_batch_size", "Requests fused into one encoder forward", ["modality"],
            buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "encoder_batch_tokens", "Encoder output tokens in one forward", ["modality"],
            buckets=TOKEN_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "encoder_queue_wait_seconds", "Time from admission to dispatch in a batch", ["modality", "priority"],
            buckets=SECONDS_BUCKETS, registry=r)
        self.preprocess = Histogram(
            "encoder_preprocess_seconds",
            "Media read (and hashed, with the cache) and decoded per request, and the processor call per batch",
            ["modality", "stage"], buckets=SECONDS_BUCKETS, registry=r)
        self.forward = Histogram(
            "encoder_forward_seconds", "One encoder forward", ["modality"], buckets=SECONDS_BUCKETS, registry=r)
        self.transfer = Histogram(
            "encoder_transfer_seconds", "Delivering one request's embedding", ["modality"],
            buckets=SECONDS_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "encoder_request_duration_seconds", "Whole /encode requests, admission to answer",
            ["modality", "priority"],
            buckets=SECONDS_BUCKETS, registry=r)
        self.pending = Gauge("encoder_pending_requests", "Admitted but unfinished requests", registry=r)
        self.queue_depth = Gauge("encoder_queue_depth", "Requests waiting in the scheduler queue", registry=r)
        # loop="http": the HTTP server's loop; loop="scheduler": the scheduler's own (scheduler_thread.py).
        self.loop_lag = Gauge("encoder_event_loop_lag_seconds",
                              "How late an event loop ran its last 100 ms timer", ["loop"], registry=r)
        self.loop_lag_ticks = Histogram(
            "encoder_event_loop_tick_lag_seconds", "How late each 100 ms event-loop timer ran", ["loop"],
            buckets=LAG_BUCKETS, registry=r)
        self.loop_cpu = Counter(
            "encoder_event_loop_cpu_seconds_total",
            "CPU time of the thread running an event loop: its rate near 1 is a loop with more work than it can do",
            ["loop"], registry=r)
        self.healthy = Gauge("encoder_healthy", "1 when the last health probe passed and the server is not draining",
                             registry=r)
        # The autoscaling totals, added to once per forward by the engine (on the scheduler's loop) and read at
        # scrape time (`SignalsCollector`): busy seconds, and per modality [items, rows].
        self.busy_seconds = 0.0
        self.forwarded: dict[str, list[int]] = {modality: [0, 0] for modality in modalities}
        self.queue_waits = [0] * (len(SECONDS_BUCKETS) + 1)  # encoder_queue_wait_seconds' buckets, every label
        self._cache = None
        self._window = SignalWindow(5 + len(SECONDS_BUCKETS) + 1, clock=clock)
        self.load = None  # the last `scheduling.load.QueueLoad` taken (`LoadCollector`)
        self.lanes = 1  # forwards that run side by side (data-parallel replicas), for the busy fraction
        r.register(SignalsCollector(self))
        r.register(LoadCollector(self))
        self.bytes_sent = Counter(
            "encoder_embedding_bytes_sent_total", "Embedding bytes sent to callers and prefill ranks",
            registry=r)
        self.evictions = Counter(
            "encoder_evictions_total", "Queued requests failed 503 to admit a higher-priority one at --max-pending",
            ["modality", "priority"], registry=r)
        self.parked_bytes = Gauge(
            "encoder_parked_bytes", "Embedding bytes kept for receivers that have not registered yet", registry=r)
        self.parked_embeddings = Gauge(
            "encoder_parked_embeddings", "Embeddings kept for receivers that have not registered yet", registry=r)
        self.trimmed_bytes = Counter(
            "encoder_malloc_trimmed_bytes_total", "Resident bytes given back to the system by malloc_trim",
            registry=r)
        self.housekeeping = Histogram(
            "encoder_housekeeping_seconds", "Idle-time chores: a full garbage collection, then malloc_trim",
            ["step"], buckets=SECONDS_BUCKETS, registry=r)
        for step in ("collect", "trim"):
            self.housekeeping.labels(step)
        self.performance = PerformanceWindow()
        # The series every request or batch touches: `labels()` takes a lock and builds its key on each call,
        # a memo returns the same child from a dict (the label values are few: modalities, statuses, stages).
        for metric in (self.requests_total, self.front_requests, self.request_duration, self.preprocess, self.transfer,
                       self.queue_wait, self.batch_size, self.batch_tokens, self.forward):
            metric.labels = functools.lru_cache(maxsize=None)(metric.labels)
        for modality in modalities:
            self._create_series(modality)
        for front in FRONTS:
            self.front_requests.labels(front, "200")

    def answered(self, modality: str, front: str, status: str) -> None:
        """One finished request: by its modality, and by the front that answered it."""
        self.requests_total.labels(modality, status).inc()
        self.front_requests.labels(front, status).inc()

    def answered_by_front(self) -> dict[str, dict[str, int]]:
        """`/server_info`'s `fronts`: front -> status -> finished requests (the statuses seen so far)."""
        found: dict[str, dict[str, int]] = {}
        for metric in self.front_requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    found.setdefault(sample.labels["front"], {})[sample.labels["status"]] = int(sample.value)
        return found

    def _create_series(self, modality: str) -> None:
        for status in KNOWN_STATUSES:
            self.requests_total.labels(modality, status)
        for stage in PREPROCESS_STAGES:
            self.preprocess.labels(modality, stage)
        for histogram in (self.batch_size, self.batch_tokens, self.forward, self.transfer):
            histogram.labels(modality)
        for histogram in (self.queue_wait, self.request_duration):  # the default priority's series
            histogram.labels(modality, "0")

    def record_queue_wait(self, modality: str, priority: int, seconds: float) -> None:
        """A request waited `seconds` from admission to dispatch (the scheduler, per request)."""
        self.queue_wait.labels(modality, str(priority)).observe(seconds)
        self.queue_waits[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1

    def record_forward(self, modality: str, items: int, rows: int, seconds: float) -> None:
        """One forward of `items` items giving `rows` rows took `seconds` (the engine, once per batch)."""
        self.forward.labels(modality).observe(seconds)
        self.batch_tokens.labels(modality).observe(rows)
        self.busy_seconds += seconds
        totals = self.forwarded.get(modality)
        if totals is None:
            totals = self.forwarded[modality] = [0, 0]
        totals[0] += items
        totals[1] += rows

    def signals(self) -> Signals:
        """The busy fraction, items and rows per second, the p99 queue wait and the cache hit rate over the last
        window (`SignalWindow`)."""
        items = rows = 0
        for item_count, row_count in list(self.forwarded.values()):
            items += item_count
            rows += row_count
        stats = self._cache.stats if self._cache is not None and self._cache.enabled else None
        waits = list(itertools.accumulate(self.queue_waits))
        totals = (self.busy_seconds, float(items), float(rows), float(stats.hits if stats else 0),
                  float(stats.misses if stats else 0), *waits)
        covered, change = self._window.change(totals)
        per_s = 1.0 / covered if covered > 0 else 0.0
        lookups = change[3] + change[4]
        return Signals(window_s=covered, busy_fraction=min(1.0, change[0] * per_s / max(1, self.lanes)),
                       items_per_s=change[1] * per_s, rows_per_s=change[2] * per_s,
                       queue_wait_p99_s=quantile_of_buckets(0.99, (*SECONDS_BUCKETS, float("inf")), change[5:]),
                       cache_hit_rate=change[3] / lookups if stats is not None and lookups > 0 else None)

    def watch_parked(self, read: Callable[[], tuple[int, int]]) -> None:
        """Read the parked (bytes, embeddings) at each scrape from whoever keeps them."""
        self.parked_bytes.set_function(lambda: read()[0])
        self.parked_embeddings.set_function(lambda: read()[1])

    def loop_lag_monitor(self, loop: str) -> LoopLagMonitor:
        """The monitor that feeds `encoder_event_loop_lag_seconds` and its per-tick histogram for `loop`
        ("http" or "scheduler"); start it on that loop."""
        return LoopLagMonitor(self.loop_lag.labels(loop), histogram=self.loop_lag_ticks.labels(loop),
                              cpu=self.loop_cpu.labels(loop))

    def record_housekeeping(self, released_bytes: int, collect_s: float, trim_s: float) -> None:
        """Called from the housekeeping thread (prometheus_client's metrics are thread-safe)."""
        self.trimmed_bytes.inc(released_bytes)
        self.housekeeping.labels("collect").observe(collect_s)
        self.housekeeping.labels("trim").observe(trim_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def watch_cache(self, cache) -> None:
        """Export an `cache.embedding_cache.EmbeddingCache`'s counters, read from it at every scrape."""
        self.registry.register(CacheCollector(cache))
        self._cache = cache

    def watch_store(self, connection) -> None:
        """Export the shared tier's (`cache.store_client.StoreConnection`) counters, read at every scrape."""
        self.registry.register(StoreCollector(connection))
    def watch_transport(self, transport) -> None:
        """Export a transport front's counters (`transport.stats`) and what it holds now, read at every scrape."""
        self.registry.register(TransportCollector(transport))

    def watch_ec_storage(self, storage) -> None:
        """Export a `fronts.vllm.connectors.example.SharedStorage`'s files, bytes and counters, read at every scrape."""
        self.registry.register(ECStorageCollector(storage))


class _ReadsMetrics(Collector):
    """A collector of what `ServerMetrics` holds, registered without a first collect (it would sample the
    window)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []


class SignalsCollector(_ReadsMetrics):
    """The autoscaling totals and their rates over the last window, read at scrape time."""

    def collect(self):
        metrics = self.metrics
        yield CounterMetricFamily("encoder_busy_seconds_total", "Seconds a forward ran (summed over data-parallel "
                                  "replicas): its rate over the replicas is the busy fraction",
                                  value=metrics.busy_seconds)
        items = CounterMetricFamily("encoder_items_total", "Items encoded by a forward", labels=["modality"])
        rows = CounterMetricFamily("encoder_rows_total", "Embedding rows (tokens) the forwards produced",
                                   labels=["modality"])
        for modality, (item_count, row_count) in sorted(metrics.forwarded.items()):
            items.add_metric([modality], item_count)
            rows.add_metric([modality], row_count)
        yield items
        yield rows
        signals = metrics.signals()
        for name, doc, value in (
                ("encoder_busy_fraction", "Share of the last minute a forward ran, per data-parallel replica "
                 "(0 to 1): the autoscaler's utilisation", signals.busy_fraction),
                ("encoder_items_per_second", "Items encoded per second over the last minute", signals.items_per_s),
                ("encoder_rows_per_second", "Embedding rows produced per second over the last minute",
                 signals.rows_per_s),
                ("encoder_queue_wait_p99_seconds", "99th percentile of the queue wait over the last minute "
                 "(from encoder_queue_wait_seconds' buckets)", signals.queue_wait_p99_s),
                ("encoder_signals_window_seconds", "Seconds the per-minute gauges cover (more than 60 after a "
                 "pause in scrapes, less while the server is younger)", signals.window_s)):
            yield GaugeMetricFamily(name, doc, value=value)


class LoadCollector(_ReadsMetrics):
    """The queue as the scheduler last reported it (`ServerMetrics.load`, taken just before each scrape)."""

    def collect(self):
        load = self.metrics.load
        if load is None:
            return
        queued = GaugeMetricFamily("encoder_queued_requests", "Requests (parts) waiting in the queue, by modality",
                                   labels=["modality"])
        oldest = GaugeMetricFamily("encoder_queue_oldest_wait_seconds", "How long the oldest queued request has "
                                   "waited, by modality (0: none queued)", labels=["modality"])
        for modality in sorted({*self.metrics.forwarded, *load.modalities}):
            entry = load.modalities.get(modality)
            queued.add_metric([modality], entry.queued if entry else 0)
            oldest.add_metric([modality], entry.oldest_wait_s if entry else 0.0)
        yield queued
        yield oldest
        yield GaugeMetricFamily("encoder_batches_in_flight", "Batches dispatched whose forward has not ended",
                                value=load.batches_in_flight)
        yield GaugeMetricFamily("encoder_batches_in_flight_max", "The most batches in flight at once",
                                value=load.max_in_flight)
        if load.estimated_wait_s is not None:
            yield GaugeMetricFamily("encoder_estimated_wait_seconds", "Encoder time ahead of a request arriving "
                                    "now, from the learned forward cost (absent until known)",
                                    value=load.estimated_wait_s)


class CacheCollector(Collector):
    """The embedding cache's counters as Prometheus series, read at scrape time (no double bookkeeping)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats
        yield CounterMetricFamily("encoder_cache_hits_total", "Items served without an encode of their own "
                                  "(from the cache, or by joining an identical item's encode in flight)",
                                  value=stats.hits)
        yield CounterMetricFamily("encoder_cache_misses_total", "Items encoded because the cache did not hold them",
                                  value=stats.misses)
        yield CounterMetricFamily("encoder_cache_inflight_joins_total", "Hits that waited for an identical item's "
                                  "encode already in flight", value=stats.joined)
        yield CounterMetricFamily("encoder_cache_evictions_total", "Entries evicted to stay within --cache-bytes",
                                  value=stats.evictions)
        yield GaugeMetricFamily("encoder_cache_bytes", "Bytes the embedding cache holds (rows plus per-entry overhead)",
                                value=self.cache.bytes_held)
        yield GaugeMetricFamily("encoder_cache_entries", "Items the embedding cache holds", value=len(self.cache))


class TransportCollector(Collector):
    """One transport (a `fronts` pusher: its `stats`, `engine.memory` and `open_reservations`) as Prometheus
    series labelled with the connector it speaks, read at scrape time."""

    def __init__(self, transport) -> None:
        self.transport = transport

    def collect(self):
        stats = self.transport.stats.as_json()
        label = [stats["name"]]

        def family(kind, name, doc, value):
            metric = kind(name, doc, labels=["transport"])
            metric.add_metric(label, value)
            return metric

        yield family(CounterMetricFamily, "encoder_transport_bytes_total", "Bytes of rows written to consumers",
                     stats["bytes"])
        yield family(CounterMetricFamily, "encoder_transport_transfers_total", "Items written to consumers "
                     "(one per destination rank)", stats["transfers"])
        yield family(CounterMetricFamily, "encoder_transport_failures_total", "Items whose transfer failed (the "
                     "consumer refused, vanished or did not answer)", stats["failures"])
        yield family(CounterMetricFamily, "encoder_transport_seconds_total", "Seconds spent writing rows",
                     stats["seconds"])
        yield family(CounterMetricFamily, "encoder_transport_refused_total", "Items answered 503 because the "
                     "registered-memory bound was reached", stats["refused"])
        registered = getattr(self.transport, "registered_bytes", None)  # a pool registered once (NIXL)
        yield family(GaugeMetricFamily, "encoder_transport_registered_bytes", "Bytes registered with the transfer "
                     "library now", self.transport.engine.memory.bytes_held if registered is None else registered)
        held = getattr(self.transport, "held_bytes", None)
        if held is not None:
            yield family(GaugeMetricFamily, "encoder_transport_held_bytes", "Bytes of the registered pool that items "
                         "not read yet, being read or being written hold (the rest is free or evictable)", held)
        yield family(GaugeMetricFamily, "encoder_transport_open_reservations", "Reservations taken on consumers "
                     "and not completed or cancelled yet", self.transport.open_reservations)


class ECStorageCollector(Collector):
    """The vLLM producer's storage (`--ec-storage`) as Prometheus series, read at scrape time."""

    def __init__(self, storage) -> None:
        self.storage = storage

    def collect(self):
        stats = self.storage.stats
        yield GaugeMetricFamily("encoder_ec_storage_files", "Items in the vLLM EC storage (--ec-storage)",
                                value=self.storage.files)
        yield GaugeMetricFamily("encoder_ec_storage_bytes", "Bytes of the items in the vLLM EC storage",
                                value=self.storage.bytes_held)
        yield CounterMetricFamily("encoder_ec_storage_writes_total", "Items encoded and written to the EC storage",
                                  value=stats.writes)
        yield CounterMetricFamily("encoder_ec_storage_hits_total", "Items found in the EC storage, not encoded again",
                                  value=stats.hits)
        yield CounterMetricFamily("encoder_ec_storage_evictions_total",
                                  "Items deleted to keep the EC storage within --ec-storage-bytes",
                                  value=stats.evictions)


class StoreCollector(Collector):
    """The shared embedding tier (Mooncake Store, --cache-store) as Prometheus series, read at scrape time."""

    def __init__(self, connection) -> None:
        self.connection = connection

    def collect(self):
        stats = self.connection.stats
        yield CounterMetricFamily("encoder_cache_store_hits_total", "Items the local cache missed and the shared "
                                  "Store answered (rows checked), not encoded", value=stats.hits)
        yield CounterMetricFamily("encoder_cache_store_misses_total", "Items asked of the shared Store and not "
                                  "found there (or not in time, or corrupt): encoded", value=stats.misses)
        yield CounterMetricFamily("encoder_cache_store_corrupt_total", "Store objects that did not match their key "
                                  "(header, dtype, width, length, layout): served as misses", value=stats.corrupt)
        yield CounterMetricFamily("encoder_cache_store_read_timeouts_total", "Store reads past --cache-store-"
                                  "timeout-ms: served as misses", value=stats.read_timeouts)
        yield CounterMetricFamily("encoder_cache_store_read_errors_total", "Store reads that failed: served as misses",
                                  value=stats.read_errors)
        yield CounterMetricFamily("encoder_cache_store_reads_skipped_total", "Store reads not tried: the master "
                                  "unreachable or every read thread busy", value=stats.reads_skipped)
        yield CounterMetricFamily("encoder_cache_store_published_total", "Items published to the Store",
                                  value=stats.published)
        yield CounterMetricFamily("encoder_cache_store_publish_drops_total", "Items not published: the queue's "
                                  "bound (--cache-store-publish-items/-bytes) or the Store unreachable",
                                  value=stats.publish_drops)
        yield CounterMetricFamily("encoder_cache_store_publish_errors_total", "Items whose publishing failed",
                                  value=stats.publish_errors)
        pending_items, pending_bytes = self.connection.pending
        yield GaugeMetricFamily("encoder_cache_store_publish_pending_bytes", "Bytes waiting to be published",
                                value=pending_bytes)
        yield GaugeMetricFamily("encoder_cache_store_up", "1 while the Store's master answers and the protocol "
                                "is readable", value=1.0 if self.connection.up else 0.0)
        cumulative, buckets = 0, []
        for bound, count in zip((*self.connection.read_bucket_bounds, float("inf")), stats.read_buckets):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("encoder_cache_store_read_seconds", "One Store read (an item's objects), "
                                    "answered within the deadline", buckets=buckets, sum_value=stats.read_seconds_sum)
