"""`encode_server.bench.machine`: the machine line the benchmarks print beside their figures, on this machine."""

from __future__ import annotations

import os
import re
from importlib import metadata

import pytest

from encode_server.bench.machine import cpu_model, describe_machine, field

pytestmark = pytest.mark.quick


def test_this_machine_is_described_by_its_cpu_model_cores_and_torch():
    facts, line = describe_machine()
    assert facts["cores"] == len(os.sched_getaffinity(0)) >= 1
    assert facts["torch"] == metadata.version("torch")
    cpuinfo = open("/proc/cpuinfo").read()
    assert facts["cpu"] == re.search(r"^model name\s*:\s*(.+?)\s*$", cpuinfo, re.M).group(1)
    assert line.startswith(f"machine: {facts['cpu']}, {facts['cores']} core") and f"torch {facts['torch']}" in line


def test_the_first_named_line_is_read_and_lscpu_answers_when_cpuinfo_has_none(tmp_path):
    assert field("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nmodel name\t: other\n", "Model Name") == "AMD EPYC 9B14"
    assert field("model name\t:   \nflags: x", "model name") is None
    bare = tmp_path / "cpuinfo"
    bare.write_text("processor\t: 0\nfeatures\t: fp asimd\n")  # as on some ARM machines
    assert cpu_model(bare) == cpu_model(tmp_path / "missing") != ""
