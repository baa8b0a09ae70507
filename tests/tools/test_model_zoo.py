"""The model zoo (`python -m tools.zoo`) still builds tiny checkpoints, runs the server's loader on them and reports
each pair: LLaVA served exactly, BLIP not applicable (cross-attention), and a type the server may refuse reported
with the refusal's own message, never as wrong or error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.helpers import ROOT


@pytest.mark.slow  # builds and runs three tiny models in subprocesses (about a minute on 2 cores)
def test_model_zoo_reports_served_refused_and_not_applicable_types(tmp_path):
    out = tmp_path / "zoo.json"
    done = subprocess.run([sys.executable, "-m", "tools.zoo", "--work", str(tmp_path / "work"),
                           "--only", "llava,blip,idefics2", "--markdown", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(row["model_type"], row["modality"]): row for row in json.loads(out.read_text())["with torchvision"]}
    assert rows[("llava", "image")]["result"] == "exact", rows[("llava", "image")]
    assert "rows [576, 576, 576]" in rows[("llava", "image")]["detail"]  # CLIP at 336/14, class token dropped
    assert rows[("blip", "-")]["result"] == "not applicable"
    idefics2 = rows[("idefics2", "image")]
    assert idefics2["result"] in ("exact", "refused"), idefics2
    if idefics2["result"] == "refused":
        assert idefics2["detail"].startswith("at load: CheckpointError:"), idefics2
    assert "| llava | image | exact |" in done.stdout
    assert "exact 1 of 2 buildable pairs" in done.stdout or "exact 2 of 2 buildable pairs" in done.stdout


def test_summary_counts_pairs_by_modality():
    from tests.support.zoo.run import summary

    rows = [{"model_type": "a", "modality": "image", "result": "exact", "detail": ""},
            {"model_type": "b", "modality": "audio", "result": "refused", "detail": ""},
            {"model_type": "b", "modality": "image", "result": "wrong", "detail": ""},
            {"model_type": "e", "modality": "video", "result": "exact", "detail": ""},
            {"model_type": "c", "modality": "-", "result": "not applicable", "detail": ""},
            {"model_type": "d", "modality": "-", "result": "unbuildable", "detail": ""}]
    assert summary(rows).startswith("exact 2 of 4 buildable pairs (images 1/2, audio 0/1, video 1/1); wrong 1, "
                                    "refused 1, "
                                    "error 0; not applicable 1 types, unbuildable 1")


def test_the_combined_table_has_a_result_column_per_environment_and_each_ones_summary():
    from tests.support.zoo.run import combined_markdown

    report = {"with torchvision": [{"model_type": "a", "modality": "image", "result": "exact", "detail": "rows [4]"},
                                   {"model_type": "b", "modality": "video", "result": "exact", "detail": "rows [8]"}],
              "without torchvision": [{"model_type": "a", "modality": "image", "result": "exact",
                                       "detail": "rows [4]"},
                                      {"model_type": "b", "modality": "video", "result": "refused",
                                       "detail": "needs | torchvision"}]}
    lines = combined_markdown(report).splitlines()
    assert lines[0] == "| model_type | modality | with torchvision | without torchvision | detail |"
    assert lines[2] == "| a | image | exact | exact | rows [4] |"
    assert lines[3] == ("| b | video | exact | refused | with torchvision: rows [8]; without torchvision: needs \\| "
                        "torchvision |")
    assert lines[5].startswith("- with torchvision: exact 2 of 2 buildable pairs")
    assert lines[6].startswith("- without torchvision: exact 1 of 2 buildable pairs")
