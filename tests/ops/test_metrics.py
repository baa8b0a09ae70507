"""Metrics that exist before their first observation, the performance window's throughput, and the
parked-embedding gauges, in-process."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from encode_server.ops.metrics import KNOWN_STATUSES, PerformanceWindow, ServerMetrics

pytestmark = pytest.mark.quick


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_single_request_reads_as_its_rate_over_the_time_covered():
    clock = Clock()
    window = PerformanceWindow(window_s=60, clock=clock)
    clock.now += 30.0
    window.record(0.048, batch_size=1)  # the case: 1 request, 48 ms, read at once
    summary = window.summary(max_batch_size=32, queue_depth=0)
    assert summary["requests"] == 1 and summary["covered_s"] == pytest.approx(30.0)
    assert summary["throughput_rps"] == pytest.approx(1 / 30.0)  # not 1 / 0.048 = 20.8
    clock.now += 100.0  # an old server: the window covers its full 60 s
    window.record(0.01, batch_size=1)
    window.record(0.01, batch_size=1)
    summary = window.summary(max_batch_size=32, queue_depth=0)
    assert summary["requests"] == 2 and summary["covered_s"] == 60.0
    assert summary["throughput_rps"] == pytest.approx(2 / 60.0)


def test_steady_rate_reads_as_that_rate_once_the_window_is_full():
    clock = Clock()
    window = PerformanceWindow(window_s=60, clock=clock)
    for _ in range(1200):  # 10 requests per second for 120 s
        clock.now += 0.1
        window.record(0.005, batch_size=2)
    assert window.summary(max_batch_size=8, queue_depth=0)["throughput_rps"] == pytest.approx(10.0, rel=0.01)


def test_a_fresh_window_reads_zero():
    clock = Clock()
    summary = PerformanceWindow(clock=clock).summary(max_batch_size=8, queue_depth=0)
    assert summary["requests"] == 0 and summary["throughput_rps"] == 0.0 and summary["covered_s"] == 0.0


def test_labelled_series_exist_at_zero_for_the_models_modalities():
    found = samples(ServerMetrics(modalities=("image", "video")))
    for modality in ("image", "video"):
        for status in KNOWN_STATUSES:
            assert found[("encoder_requests_total", (("modality", modality), ("status", status)))] == 0
        for stage in ("decode", "processor"):
            assert found[("encoder_preprocess_seconds_count", (("modality", modality), ("stage", stage)))] == 0
        for histogram in ("encoder_batch_size", "encoder_batch_tokens", "encoder_forward_seconds",
                          "encoder_transfer_seconds"):
            assert found[(histogram + "_count", (("modality", modality),))] == 0
        for histogram in ("encoder_queue_wait_seconds", "encoder_request_duration_seconds"):  # by priority too
            assert found[(histogram + "_count", (("modality", modality), ("priority", "0")))] == 0
    assert not any(dict(labels).get("modality") == "audio" for _, labels in found)  # only the model's own


def test_without_modalities_no_labelled_series_are_made_up():
    found = samples(ServerMetrics())
    assert not any(name == "encoder_requests_total" for name, _ in found)


def test_parked_gauges_read_the_keeper_at_each_scrape_and_memory_is_exported():
    metrics = ServerMetrics(modalities=("image",))
    parked = {"bytes": 0, "entries": 0}
    metrics.watch_parked(lambda: (parked["bytes"], parked["entries"]))
    assert samples(metrics)[("encoder_parked_bytes", ())] == 0
    parked.update(bytes=3 << 20, entries=2)
    found = samples(metrics)
    assert found[("encoder_parked_bytes", ())] == 3 << 20 and found[("encoder_parked_embeddings", ())] == 2
    assert found[("process_resident_memory_bytes", ())] > 10 << 20


# --- the autoscaling signals --------------------------------------------------------------------

def test_busy_fraction_rates_and_p99_queue_wait_over_the_window_as_read_at_scrape_time():
    clock = Clock()
    metrics = ServerMetrics(modalities=("image",), clock=clock)
    clock.now += 10.0
    for _ in range(3):
        metrics.record_forward("image", items=4, rows=16, seconds=1.0)
    for _ in range(99):
        metrics.record_queue_wait("image", 0, 0.001)
    metrics.record_queue_wait("image", 0, 100.0)  # past the last bound: counted, in +Inf
    signals = metrics.signals()
    assert signals.window_s == 10.0 and signals.busy_fraction == pytest.approx(0.3)
    assert (signals.items_per_s, signals.rows_per_s) == (pytest.approx(1.2), pytest.approx(4.8))
    assert signals.queue_wait_p99_s == pytest.approx(0.001)  # 99 of 100 within the 1 ms bucket
    assert signals.cache_hit_rate is None  # no cache watched
    exported = samples(metrics)
    assert exported[("encoder_busy_seconds_total", ())] == 3.0
    assert exported[("encoder_items_total", (("modality", "image"),))] == 12
    assert exported[("encoder_rows_total", (("modality", "image"),))] == 48
    assert exported[("encoder_busy_fraction", ())] == pytest.approx(0.3)
    assert exported[("encoder_queue_wait_p99_seconds", ())] == pytest.approx(0.001)
    # Over a minute later with nothing new, the window starts after those forwards: all of it reads 0. It spans
    # from the newest read at least 60 s old (at 110 s), not a full 60 s: reads are the samples.
    clock.now += 30.0
    metrics.signals()
    clock.now += 45.0
    quiet = metrics.signals()
    assert quiet.window_s == pytest.approx(75.0)
    assert (quiet.busy_fraction, quiet.items_per_s, quiet.queue_wait_p99_s) == (0.0, 0.0, 0.0)


def test_the_busy_fraction_is_per_data_parallel_replica():
    clock = Clock()
    metrics = ServerMetrics(clock=clock)
    metrics.lanes = 2
    clock.now += 4.0
    metrics.record_forward("image", 1, 4, 3.0)
    metrics.record_forward("image", 1, 4, 3.0)  # two replicas' forwards, side by side
    assert metrics.signals().busy_fraction == pytest.approx(0.75)


def test_the_queue_gauges_show_the_last_load_taken():
    from encode_server.scheduling.load import ModalityLoad, QueueLoad

    metrics = ServerMetrics(modalities=("image", "video"))
    assert ("encoder_queued_requests", (("modality", "image"),)) not in samples(metrics)  # none taken yet
    metrics.load = QueueLoad({"image": ModalityLoad(3, 12, 0.25)}, batches_in_flight=2, max_in_flight=2,
                             estimated_wait_s=0.5)
    exported = samples(metrics)
    assert exported[("encoder_queued_requests", (("modality", "image"),))] == 3
    assert exported[("encoder_queued_requests", (("modality", "video"),))] == 0
    assert exported[("encoder_queue_oldest_wait_seconds", (("modality", "image"),))] == 0.25
    assert exported[("encoder_batches_in_flight", ())] == 2
    assert exported[("encoder_estimated_wait_seconds", ())] == 0.5
