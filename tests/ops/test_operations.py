"""Operations: metrics that move, the dashboard against live metric names, graceful drain on
SIGTERM, the cached health probe, and structured logs."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from encode_server.http.error_log import LINES_PER_SECOND, LineBudget
from encode_server.ops.health import HealthProbe
from encode_server.ops.metrics import LoopLagMonitor, PerformanceWindow
from tests.support.helpers import ROOT, ServerProcess, image_b64

DASHBOARD = ROOT / "deploy" / "grafana" / "encode-server.json"


def families(url: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def sample(fams: dict, name: str, sample_name: str | None = None, **labels) -> float:
    """The sum of the family's samples with that name and those labels (0 when none)."""
    family = fams[name]
    return sum(s.value for s in family.samples
               if s.name == (sample_name or name) and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--health-probe-interval-s", "0.3", "--log-level", "debug") as process:
        yield process


def test_metrics_move_under_load_with_millisecond_buckets(server):
    before = families(server.url)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(server.url + "/encode", json={
                "req_id": f"m{i}", "modality": "image", "mm_items": [image_b64(56, 56, seed=i)],
                "return_embedding": True}) for i in range(24)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    httpx.post(server.url + "/encode", json={"req_id": "bad", "modality": "image", "mm_items": ["@@"]})
    after = families(server.url)
    ok = "encoder_requests"
    assert sample(after, ok, "encoder_requests_total", status="200") - \
        sample(before, ok, "encoder_requests_total", status="200") == 24
    assert sample(after, ok, "encoder_requests_total", status="400") >= 1
    for histogram in ("encoder_batch_size", "encoder_batch_tokens", "encoder_queue_wait_seconds",
                      "encoder_forward_seconds", "encoder_request_duration_seconds", "encoder_preprocess_seconds",
                      "encoder_transfer_seconds"):
        assert sample(after, histogram, histogram + "_count") > sample(before, histogram, histogram + "_count"), \
            histogram
    buckets = {s.labels["le"] for s in after["encoder_forward_seconds"].samples if s.name.endswith("_bucket")}
    assert {"0.001", "0.0025", "0.005"} <= buckets, "millisecond encoders need millisecond buckets"
    assert sample(after, "encoder_embedding_bytes_sent", "encoder_embedding_bytes_sent_total") >= 24 * 4 * 128 * 4
    assert sample(after, "encoder_pending_requests") == 0
    assert "encoder_event_loop_lag_seconds" in after and "encoder_queue_depth" in after
    # Both loops are watched: the HTTP server's and the scheduler's own (each ticks every 100 ms).
    for loop in ("http", "scheduler"):
        ticks = sample(after, "encoder_event_loop_tick_lag_seconds", "encoder_event_loop_tick_lag_seconds_count",
                       loop=loop)
        assert ticks > 0, loop
    # ... and the CPU of the thread running each: the HTTP loop parsed 24 requests' worth, and neither
    # loop can have used more than a core for the time the server has run.
    cpu = {loop: sample(after, "encoder_event_loop_cpu_seconds", "encoder_event_loop_cpu_seconds_total", loop=loop)
           for loop in ("http", "scheduler")}
    assert cpu["http"] > 0 and cpu["scheduler"] >= 0, cpu
    uptime = time.time() - sample(after, "process_start_time_seconds")
    assert max(cpu.values()) <= uptime, (cpu, uptime)
    assert sample(after, "encoder_healthy") == 1


def test_every_dashboard_query_uses_an_exported_metric(server):
    httpx.post(server.url + "/encode", json={"req_id": "dash", "modality": "image", "mm_items": [image_b64(56, 56)]})
    exported = set()
    for family in families(server.url).values():
        exported.update(s.name for s in family.samples)
        exported.add(family.name)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(queries) >= 10
    used = {name for query in queries for name in re.findall(r"\bencoder_[a-z_]+\b", query)}
    # The shared tier's series exist with --cache-store only: test_store_format checks them against its collector.
    used = {name for name in used if not name.startswith("encoder_cache_store_")}
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("throughput", "latency", "batch size", "queue", "errors"):
        assert topic in titles


def test_health_probe_goes_through_the_encoder_and_is_cached(server):
    forwards = lambda: sample(families(server.url), "encoder_forward_seconds", "encoder_forward_seconds_count")  # noqa: E731
    start = forwards()
    for _ in range(3):
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        time.sleep(0.4)
    probed = forwards()
    assert probed >= start + 2, "a /health older than the interval must run a probe through the encoder"
    began = time.monotonic()
    for _ in range(5):  # inside the interval: cached, no new forward
        httpx.get(server.url + "/health")
    # At most one probe per interval (0.3 s) the five took: none on an idle machine, where they take a few
    # milliseconds; a loaded one may stretch them over several intervals, each of which may rightly probe.
    after = forwards()  # a scrape keeps encoder_healthy current, and may itself probe once per interval
    intervals = int((time.monotonic() - began) / 0.3)
    assert after <= probed + 1 + intervals


def test_structured_logs_per_batch_and_per_request(server):
    httpx.post(server.url + "/encode", json={"req_id": "logged-req", "modality": "image",
                                            "mm_items": [image_b64(56, 56)]})
    time.sleep(0.2)
    log = server.log()
    assert re.search(r"batch modality=image size=\d+ items=\d+ tokens=\d+ preprocess_ms=[\d.]+ forward_ms=", log)
    assert re.search(r"request req_id=logged-req part=0 modality=image items=1 status=200 duration_ms=", log)


def test_sigterm_drains_requests_in_flight_then_exits_zero():
    with ServerProcess("--max-wait-ms", "1500", "--min-batch-size", "100", "--hard-timeout-additional-s", "0",
                       "--drain-timeout-s", "10") as server:
        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                in_flight = [asyncio.ensure_future(client.post(server.url + "/encode", json={
                    "req_id": f"drain-{i}", "modality": "image", "mm_items": [image_b64(56, 56)]}))
                    for i in range(4)]
                await asyncio.sleep(0.4)
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                health = await client.get(server.url + "/health")
                refused = await client.post(server.url + "/encode", json={
                    "req_id": "late", "modality": "image", "mm_items": [image_b64(56, 56)]})
                return health, refused, await asyncio.gather(*in_flight)

        health, refused, answers = asyncio.run(scenario())
        assert health.status_code == 503 and "draining" in health.json()["message"]
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert [a.status_code for a in answers] == [200] * 4
        assert server.proc.wait(timeout=20) == 0


def test_drain_timeout_fails_what_is_left_and_still_exits_zero():
    with ServerProcess("--max-wait-ms", "30000", "--min-batch-size", "100", "--drain-timeout-s", "0.5") as server:
        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                stuck = asyncio.ensure_future(client.post(server.url + "/encode", json={
                    "req_id": "stuck", "modality": "image", "mm_items": [image_b64(56, 56)]}))
                await asyncio.sleep(0.4)
                server.proc.send_signal(signal.SIGTERM)
                return await stuck

        started = time.monotonic()
        answer = asyncio.run(scenario())
        assert answer.status_code == 503 and time.monotonic() - started < 10
        assert server.proc.wait(timeout=20) == 0


# --- the pieces on their own ------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_health_probe_caches_refreshes_and_times_out():
    clock = FakeClock()
    calls = []
    gate = asyncio.Event()

    async def probe():
        calls.append(clock.now)
        if len(calls) == 2:
            raise RuntimeError("forward exploded")
        if len(calls) == 3:
            await gate.wait()

    async def settle():  # let the probe task run to its end
        for _ in range(10):
            await asyncio.sleep(0)

    async def scenario():
        health = HealthProbe(probe, interval_s=5, timeout_s=10, clock=clock)
        assert health.verdict() == (True, "first probe running")
        await settle()
        assert health.verdict() == (True, "ok") and len(calls) == 1
        clock.now = 4.9
        health.verdict()
        await settle()
        assert len(calls) == 1, "fresh verdicts are cached"
        clock.now = 5.0
        health.verdict()
        await settle()
        ok, message = health.verdict()
        assert not ok and "forward exploded" in message
        clock.now = 10.0
        health.verdict()  # third probe hangs
        await settle()
        assert health.verdict()[0] is False  # still the last verdict while it runs
        clock.now = 21.0
        ok, message = health.verdict()
        assert not ok and "has not finished" in message
        gate.set()
        await health.close()

    asyncio.run(scenario())


def test_loop_lag_monitor_sees_a_blocked_loop():
    from prometheus_client import CollectorRegistry

    gauge = Gauge("lag_test", "lag", registry=CollectorRegistry())

    async def scenario():
        monitor = LoopLagMonitor(gauge, interval_s=0.05)
        monitor.start()
        await asyncio.sleep(0.12)
        quiet = gauge._value.get()
        time.sleep(0.3)  # block the loop on purpose: the next tick runs about 0.3 s late
        await asyncio.sleep(0.01)  # the overdue tick runs before this timer
        monitor.stop()
        return quiet

    quiet = asyncio.run(scenario())
    assert quiet < 0.05
    assert 0.2 <= gauge._value.get() < 1.0


def test_loop_lag_monitor_counts_its_threads_cpu():
    """A loop that computes for 0.3 s adds about that much CPU; one that sleeps 0.3 s adds almost none.
    Lag alone cannot tell the two apart when another thread holds the loop's thread up."""
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    gauge = Gauge("lag_cpu_test", "lag", registry=registry)
    cpu = Counter("lag_cpu_test_cpu", "cpu", registry=registry)

    def busy(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def scenario() -> tuple[float, float]:
        monitor = LoopLagMonitor(gauge, interval_s=0.05, cpu=cpu)
        monitor.start()
        await asyncio.sleep(0.3)  # idle: the thread sleeps in the selector
        idle = cpu._value.get()
        busy(0.3)
        await asyncio.sleep(0.12)  # two ticks: the overdue one and the next
        monitor.stop()
        return idle, cpu._value.get() - idle

    idle, worked = asyncio.run(scenario())
    assert idle < 0.1
    assert 0.25 <= worked < 0.6


def test_performance_window_forgets_after_its_span():
    clock = FakeClock()
    window = PerformanceWindow(window_s=60, clock=clock)
    for latency in (0.01, 0.02, 0.03, 0.5):
        window.record(latency, batch_size=4)
    clock.now = 10
    summary = window.summary(max_batch_size=8, queue_depth=3)
    assert summary["requests"] == 4 and summary["avg_batch_size"] == 4 and summary["batching_efficiency"] == 0.5
    assert summary["latency_ms"]["p50"] == pytest.approx(30) and summary["latency_ms"]["p99"] == pytest.approx(500)
    assert summary["queue_depth"] == 3 and summary["throughput_rps"] == pytest.approx(0.4)
    clock.now = 71
    assert window.summary(8, 0)["requests"] == 0


def test_dashboard_file_is_valid_grafana_json():
    dashboard = json.loads(Path(DASHBOARD).read_text())
    assert dashboard["title"] == "encode-server" and dashboard["panels"]
    assert all("gridPos" in panel and panel["targets"] for panel in dashboard["panels"])


# --- what the server says: its version, its start-up, and every error answer ----------------------

def test_version_flag_prints_the_package_version():
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", "encode_server", "--version"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"encode-server {version('encode-server')}"


def test_line_budget_lets_a_few_lines_a_second_through_and_counts_the_rest():
    clock = [0.0]
    budget = LineBudget(per_second=3, clock=lambda: clock[0])
    assert [budget.take() for _ in range(5)] == [0, 0, 0, None, None]
    clock[0] = 0.5
    assert budget.take() is None  # same window
    clock[0] = 1.2
    assert budget.take() == 3  # the first line of the next window says how many were left out
    assert budget.take() == 0


def test_start_up_steps_and_every_error_answer_are_logged_at_the_default_level():
    """At `--log-level info` (the default) the start-up says what it does, and each 4xx/5xx answer is one
    line with its status, request id and reason; a flood is cut to `LINES_PER_SECOND`, and the next line
    written counts what was left out, so every error answer is accounted for."""
    from importlib.metadata import version

    from encode_server.ops.settings import Settings

    assert Settings().log_level == "info"
    with ServerProcess("--log-level", "info", "--api-key", "k") as server:
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(server.url + "/server_info", headers=auth).json()["version"] == version("encode-server")
        startup = server.log()
        for step in ("loading model tiny-qwen2.5-vl", "warming up tiny-qwen2.5-vl", "ready in"):
            assert step in startup, startup
        assert re.search(r"encode-server ready: http://127\.0\.0\.1:\d+ \(started in [\d.]+ s\)", startup)
        bad = {"req_id": "bad-1", "modality": "image", "mm_items": ["bm90IGFuIGltYWdl"]}
        assert httpx.post(server.url + "/encode", json=bad, headers=auth).status_code == 400
        assert httpx.get(server.url + "/server_info").status_code == 401
        time.sleep(1.1)  # a fresh window for the flood

        async def flood() -> None:
            async with httpx.AsyncClient(headers=auth, timeout=60) as client:
                await asyncio.gather(*(client.post(server.url + "/encode", json={**bad, "req_id": f"flood-{i}"})
                                       for i in range(60)))

        asyncio.run(flood())
        time.sleep(1.1)
        after = httpx.post(server.url + "/encode", json={**bad, "req_id": "after-flood"}, headers=auth)
        assert after.status_code == 400
        time.sleep(0.3)
        log = server.log()
    assert re.search(r"answered 400 to POST /encode req_id=bad-1: mm_items\[0\]: not a decodable image", log)
    assert "answered 401 to GET /server_info req_id=-: missing API key" in log
    flood_lines = re.findall(r"answered 400 to POST /encode req_id=(?:flood-\d+|after-flood):.*", log)
    left_out = sum(int(n) for n in re.findall(r"\((\d+) more error answers were not logged", log))
    assert left_out > 0 and len(flood_lines) - 1 >= LINES_PER_SECOND, "the flood is cut to a few lines a second"
    assert len(flood_lines) + left_out == 61, "every error answer is either logged or counted"
    # The count is told within a second of the flood, without waiting for another error answer.
    told = re.search(r"INFO encode_server.http.errors: \(\d+ more error answers were not logged", log)
    assert told and told.start() < log.index("req_id=after-flood"), log[-2000:]
