"""`benchmarks/sglang_compare.py`: its flags, the request body it sends and its table (no server is started;
the comparison itself is a measurement, run by hand as its module docstring says)."""

from __future__ import annotations

import pickle

import pytest

from benchmarks.peer_compare import Point, summarise, table
from benchmarks.sglang_compare import RID, parse_args, request_body
from encode_server.bench.__main__ import main as encode_bench

pytestmark = pytest.mark.quick


def test_encode_bench_names_the_peer_comparisons_it_does_not_ship(tmp_path):
    """The installed `encode-bench` holds no peer: asked for one, it names the checkout's benchmark, before
    starting anything."""
    for peer in ("sglang", "ray"):
        with pytest.raises(SystemExit, match=rf"unknown configuration '{peer}'.*benchmarks/sglang_compare.py"):
            encode_bench(["--compare", f"on,{peer}", "--out", str(tmp_path / peer)])
        assert not (tmp_path / peer).exists()


def test_flags_defaults_and_errors(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_PYTHON", "/opt/sglang/bin/python")
    args = parse_args([])
    assert (args.configs, args.rounds, args.requests, args.concurrency) == (["ours", "sglang", "sglang-batch32"], 2,
                                                                           400, 64)
    assert args.sglang_python == "/opt/sglang/bin/python" and (args.server_core, args.client_core) == (0, 1)
    assert parse_args(["--sglang-python", "py", "--configs", "sglang,ours"]).configs == ["sglang", "ours"]
    with pytest.raises(SystemExit):
        parse_args(["--configs", "ours,vllm"])
    assert "unknown --configs vllm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_the_body_is_sglangs_zmq_to_scheduler_form_with_the_ports_in_it():
    body = request_body("http://127.0.0.1:5", "cmp-001-000007", "aGk=", 4242)
    assert body["embedding_port"] == [4242] and body["prefill_host"] == "127.0.0.1"
    assert (body["modality"], body["mm_items"], body["num_parts"], body["part_idx"]) == ("IMAGE", ["aGk="], 1, 0)


def test_a_request_id_is_found_in_a_pickled_frame_and_never_by_its_prefix():
    frame = pickle.dumps({"req_id": "cmp-003-000012", "num_parts": 1})
    assert RID.search(frame).group(0) == b"cmp-003-000012"
    assert RID.search(pickle.dumps({"req_id": "cmp-003-00001"})) is None


def test_the_table_gives_medians_ranges_and_ratios_to_each_sglang_setting():
    points = [Point("ours", 0, 400, 0, 500.0, 90.0, 120.0, 1.5), Point("sglang", 0, 400, 0, 250.0, 150.0, 300.0, 3.0),
              Point("ours", 1, 400, 0, 400.0, 100.0, 140.0, 1.7), Point("sglang", 1, 400, 1, 200.0, 170.0, 280.0, None)]
    rows = summarise(points)
    ours, sglang = rows
    assert ours["throughput_rps"] == 450.0 and ours["throughput_rps_range"] == (400.0, 500.0)
    assert sglang["cpu_ms_per_request"] == 3.0 and sglang["errors"] == 1 and sglang["rounds"] == 2
    text = table(rows)
    assert "| ours | 2 | 450 (400-500) | 95.0 (90.0-100.0) | 130.0 (120.0-140.0) | 1.60 (1.50-1.70) | 0 |" in text
    assert "ours / sglang: throughput x2.00, p99 x0.45 (medians)" in text
