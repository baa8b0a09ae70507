"""Test tiers and parallel runs.

- `quick`: the in-process specification (policy, queues, scheduler, service on a fake clock, cache,
  wire formats, settings, layout, the families' parity on tiny models): no server process, no
  worker ranks. For the edit-test loop: `bash scripts/test.sh -m quick`.
- the default run (what CI runs): everything but `slow`, spread over the machine's cores
  (pytest-xdist, `-n auto` in pyproject.toml).
- `slow`: long benchmarks and soaks, which measure the machine: they run one at a time.

The processes tests start with `python -m` (servers, ranks, failing starts) are forked from a zygote that has
imported torch and transformers once (`tests/zygote.py`, through `tests.helpers.python_module`); `ZYGOTE=0`
starts new interpreters instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Network safety: nothing in the tests may reach the real Hugging Face Hub. Tests of models by Hub id run a
# stand-in on loopback and set these variables for their own processes; anything else that would resolve a
# Hub id fails at once, offline, and any request that slips through goes to a loopback port nobody serves.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

#: The quick tier: test modules that start no server or worker process, chosen by measured time (the family
#: modules that build and compare several tiny checkpoints are left to the full suite; run one directly while
#: working on that family).
QUICK_MODULES = frozenset({
    "test_bench_sglang_compare", "test_bench_workloads", "test_cost_model", "test_demand", "test_embedding_cache",
    "test_endpoints", "test_family_gemma3", "test_family_glm4v", "test_family_minimax_m3_vl", "test_fast_patches",
    "test_housekeeping", "test_layout", "test_logs", "test_media_inline", "test_messages", "test_metrics",
    "test_packed_attention", "test_patch_embed", "test_policy", "test_policy_queue", "test_prefill_counts",
    "test_priority_pool", "test_qwen_video_settings", "test_registrations", "test_safetensors_ranges",
    "test_scheduler", "test_scheduler_priority", "test_scheduler_thread", "test_sender", "test_service",
    "test_service_priority", "test_settings", "test_sglang_wire", "test_wire_deepstack", "test_omni_delivery",
    "test_store_format",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).stem in QUICK_MODULES and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.quick)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, but none (a plain serial run) when slow tests are selected:
    benchmarks and soaks measure the machine and must not share it."""
    selection = config.getoption("markexpr", "") or ""
    if "slow" in selection and "not slow" not in selection:
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
