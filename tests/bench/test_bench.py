"""A smoke run of `encode-bench` with tiny numbers (the real runs are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from encode_server.bench.__main__ import main
from encode_server.ops.settings import Settings
from tests.support.helpers import ServerProcess, python_module, run_python_module


def test_bench_smoke_run_writes_results_for_each_configuration(tmp_path, monkeypatch):
    """`encode-bench` run here, its servers forked from the test zygote (the same servers, started faster), its
    in-process ceiling measured for 1 s instead of 5 (a smoke run checks the numbers are there and sane)."""
    import functools

    from encode_server.bench import ceiling
    from encode_server.bench.launcher import ServerProcess as Launcher

    monkeypatch.setattr(Launcher, "start_process", lambda launcher: python_module(
        launcher.module, *launcher.args, environment=launcher.env, stderr_to_stdout=True))
    monkeypatch.setattr(ceiling, "ceiling", functools.partial(ceiling.ceiling, seconds=1.0))
    out = tmp_path / "bench"
    main(["--compare", "on,off,ceiling", "--concurrency", "1,4", "--rates", "20", "--requests", "12",
          "--open-seconds", "1", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    points = results["points"]
    assert {(p["config"], p["mode"]) for p in points} == {("on", "closed"), ("off", "closed"), ("on", "open"),
                                                          ("off", "open")}
    assert all(p["errors"] == 0 and p["throughput_rps"] > 0 and p["p99_ms"] >= p["p50_ms"] > 0 for p in points)
    assert all(p["mean_batch_size"] == 1.0 for p in points if p["config"] == "off")
    assert results["ceiling"]["forward_only_rps"] > results["ceiling"]["processor_and_forward_rps"] > 0
    import torch

    if not torch.cuda.is_available():
        assert results["ceiling"]["threads"] == Settings().cpu_threads_per_rank(1)  # the servers' own thread rule
    assert sum(results["batch_histograms"]["off"].values()) >= 12


def test_the_ceiling_runs_on_the_threads_the_server_would_and_gives_the_rest_back():
    import torch

    from encode_server.bench.ceiling import ceiling
    from encode_server.bench.load import make_payloads

    before = torch.get_num_threads()
    settings = Settings(cpu_threads=3)  # more than half of a 2-core machine's: a setting, not the default
    result = ceiling("tiny-qwen2.5-vl", "image", make_payloads("image", 4, 56, 1.0), 4, seconds=0.2,
                     settings=settings)
    assert result["threads"] == (3 if not torch.cuda.is_available() else before)  # on a GPU: untouched
    assert torch.get_num_threads() == before


def test_ray_peer_is_skipped_cleanly_without_ray(tmp_path, monkeypatch):
    from benchmarks import ray_compare

    monkeypatch.setitem(sys.modules, "ray", None)
    ray_compare.main(["--compare", "ray", "--concurrency", "1", "--rates", "", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert "not installed" in results["skipped"]["ray"] and "peers" in results["skipped"]["ray"]
    assert results["points"] == []


def test_camera_one_core_pin_is_undone_for_the_modes_after_it():
    """The in-process camera loop pins itself to one core; the pool and service modes that follow (and the
    processes they start, which inherit the affinity) must get every core back."""
    import os

    import pytest

    from benchmarks.camera import one_core

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    allowed = os.sched_getaffinity(0)
    with one_core():
        assert os.sched_getaffinity(0) == {min(allowed)}
    assert os.sched_getaffinity(0) == allowed


def test_camera_stages_time_each_size_on_one_core(tmp_path):
    """`--mode stages`: decode, processor and forward of one image of each camera size (a tiny tower)."""
    import os

    from benchmarks.camera import camera_jpegs, camera_tower, run_stages

    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    result = run_stages(camera_tower(tmp_path / "camera"), camera_jpegs(2), repeats=1)
    assert set(result) == {"mode", "1280x720", "1920x1080", "batch of 2"}
    assert all(stage > 0 for size in ("1280x720", "1920x1080", "batch of 2") for stage in result[size].values())
    if allowed is not None:
        assert os.sched_getaffinity(0) == allowed


def test_bench_against_a_running_server_measures_the_encoder_not_its_cache(tmp_path):
    """`encode-bench --url` against a server whose cache is on: distinct media by default (hit rate 0), and
    with --repeat-media the hit rate it measured from /metrics, with a warning."""
    with ServerProcess("--cache-bytes", "64MiB") as server:
        def bench(*extra: str) -> tuple[subprocess.CompletedProcess, dict]:
            out = tmp_path / ("repeat" if extra else "distinct")
            done = run_python_module("encode_server.bench", "--url", server.url, "--concurrency", "2", "--rates", "",
                                     "--out", str(out), *extra, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
            return done, json.loads((out / "results.json").read_text())

        distinct, results = bench("--requests", "16")
        assert results["hit_rate"] == 0.0 and "cache hit rate over the run: 0.0%" in distinct.stdout
        assert "warning" not in distinct.stderr
        repeated, results = bench("--requests", "64", "--repeat-media")
        assert results["hit_rate"] > 0.5 and "the figures measure the cache" in repeated.stdout
        assert "warning: the server's embedding cache answered" in repeated.stderr


def test_the_mixed_benchmark_prints_the_tables_the_docs_show(capsys, monkeypatch):
    """`python benchmarks/mixed.py wait` (tiny numbers, its server forked from the test zygote) ends
    with the Markdown table of docs/BENCHMARKS.md, not JSON; `--json` gives the JSON."""
    from benchmarks import mixed
    from benchmarks.mixed_tables import mixed_table
    from encode_server.bench.launcher import ServerProcess as Launcher

    monkeypatch.setattr(Launcher, "start_process", lambda launcher: python_module(
        launcher.module, *launcher.args, environment=launcher.env, stderr_to_stdout=True))
    mixed.main(["wait", "--waits", "0", "--concurrency", "1,2", "--requests", "8"])
    out = capsys.readouterr().out
    table = out[out.index("| `--max-wait-ms` |"):].splitlines()
    assert table[0] == "| `--max-wait-ms` | c=1 req/s (p99 ms) | c=2 req/s (p99 ms) | mean batch c=1 / c=2 | errors |"
    assert table[2].startswith("| 0 | ") and table[2].endswith(" | 0 |") and len(table) == 3
    assert "--max-wait-ms 0, c=2: " in out and not out.lstrip().startswith("{")

    median = {arm: {"interactive_p50_ms": 10.0, "interactive_p99_ms": 30.0, "offline_rps": 500.0, "total_rps": 600.0,
                    "interactive_errors": 0, "interactive_requests": 90} for arm in ("idle", "fifo", "priority")}
    rows = mixed_table({"off": {"capacity_rps": 650.0, "median": median}}).splitlines()
    assert rows[0].startswith("| cache | capacity (req/s) | arm | interactive p50 (ms) | interactive p99 (ms) |")
    assert rows[2] == "| off | 650.0 | idle | 10.0 | 30.0 | - | 600.0 | 0 of 90 |"
    assert rows[3] == "|  |  | fifo | 10.0 | 30.0 | 500.0 | 600.0 | 0 of 90 |"
