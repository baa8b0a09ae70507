"""`encode-bench` as a new user meets it: every flag explained, published results never overwritten by accident,
a missing plotting library named, `--replot` saying what it wrote (in-process, no server started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from encode_server.bench import __main__ as bench

pytestmark = pytest.mark.quick


def test_every_flag_says_what_it_does():
    parser = bench.build_parser()
    undocumented = [action.option_strings for action in parser._actions if not action.help]
    assert undocumented == []
    text = " ".join(parser.format_help().split())
    for config in bench.CONFIGS:
        assert config in text
    assert "closed-loop points" in text and "open-loop points" in text and "side in pixels" in text


def test_results_git_tracks_are_refused_before_anything_runs(tmp_path, capsys):
    """As `--out docs/bench` in a checkout: the published figures are not replaced unless asked."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    published = tmp_path / "docs" / "bench"
    published.mkdir(parents=True)
    (published / "results.json").write_text("{}")
    (published / "notes.txt").write_text("")
    subprocess.run(["git", "-C", str(tmp_path), "add", "docs"], check=True)
    assert bench.tracked_outputs(published) == ["results.json"]
    assert bench.tracked_outputs(tmp_path / "bench-results" / "new") == []  # not yet made, not tracked
    for argv in (["--compare", "on"], ["--replot"]):
        with pytest.raises(SystemExit, match=r"--out .*docs/bench holds results that git tracks \(results.json\).*"
                                             r"--overwrite-tracked"):
            bench.main([*argv, "--out", str(published)])
    assert (published / "results.json").read_text() == "{}"
    bench.check_out(published, overwrite_tracked=True)  # asked for: allowed


def test_without_matplotlib_the_plots_are_skipped_saying_which_extra_draws_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    (tmp_path / "results.json").write_text(json.dumps({"points": []}))
    assert bench.replot(tmp_path) == []
    out, err = capsys.readouterr()
    assert out == ""  # no bare "wrote "
    assert "plots skipped: matplotlib is not installed" in err and "pip install 'encode-server[bench]'" in err


def test_replot_names_the_files_it_wrote(tmp_path, monkeypatch, capsys):
    """What `--replot` prints comes from what `plot` reports writing (here a stand-in for matplotlib's drawing,
    which the test environment does not install)."""
    (tmp_path / "results.json").write_text(json.dumps({"points": []}))
    monkeypatch.setattr(bench, "plot", lambda results, out: ["throughput.png", "latency.png"])
    bench.main(["--replot", "--out", str(tmp_path)])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'throughput.png'}, {tmp_path / 'latency.png'}\n"
    with pytest.raises(SystemExit, match="results.json does not exist: give the --out of an earlier run"):
        bench.main(["--replot", "--out", str(tmp_path / "elsewhere")])
