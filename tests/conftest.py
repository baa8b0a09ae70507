"""Test tiers and parallel runs.

- `quick`: the in-process specification (policy, queues, scheduler, service on a fake clock, cache, wire formats,
  settings, layout, some families' parity on tiny models): no server process, no worker ranks. A module joins the
  tier with `pytestmark = pytest.mark.quick`. For the edit-test loop: `bash scripts/test.sh -m quick`.
- the default run (what CI runs): everything but `slow`, spread over the machine's cores (pytest-xdist,
  `-n auto` in pyproject.toml).
- `slow`: long benchmarks and soaks, which measure the machine: they run one at a time.

The processes tests start with `python -m` (servers, ranks, failing starts) are forked from a zygote that has
imported torch and transformers once (`tests/support/zygote.py`, through `tests.support.helpers.python_module`);
`ZYGOTE=0` starts new interpreters instead.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

# Network safety: nothing in the tests may reach the real Hugging Face Hub. Tests of models by Hub id run a
# stand-in on loopback and set these variables for their own processes; anything else that would resolve a
# Hub id fails at once, offline, and any request that slips through goes to a loopback port nobody serves.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

@pytest.fixture(scope="session", autouse=True)
def steady_environment() -> None:
    """Set, before any test starts a zygote, the variables that in-process code sets in os.environ as it runs: OpenCV's
    import amends LD_LIBRARY_PATH (for its subprocesses), a Mooncake Store client sets MC_LOG_LEVEL, the nixl
    transport leaves UCX's InfiniBand modules out where there is no RDMA device (UCX_MODULES). The zygotes are keyed
    by the environment, so a variable that appeared halfway through a test worker's run would cost every later start
    a new zygote (seconds of imports)."""
    if importlib.util.find_spec("cv2") is not None:
        import cv2  # noqa: F401
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # what encode_server.cache.store_client sets
    if importlib.util.find_spec("msgpack") is not None:
        from encode_server.transport.nixl import quiet_ucx_exit

        quiet_ucx_exit()


@pytest.fixture(scope="session")
def shared_hub(tmp_path_factory):
    """(a Hub stand-in, an `HF_HOME`) for every test of this test worker that fetches by Hub id: their processes have
    the same Hub variables (`hub_env`), so they fork from one zygote (a new environment costs a new one: seconds of
    imports). Each test `add`s its repositories, under ids no other test uses (no test finds another's download in
    the cache), and zeroes the counts before counting."""
    from tests.support.hub_stand_in import HubStandIn

    with HubStandIn({}) as hub:
        yield hub, tmp_path_factory.mktemp("hf-home")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core, but none (a plain serial run) when slow tests are selected:
    benchmarks and soaks measure the machine and must not share it."""
    selection = config.getoption("markexpr", "") or ""
    if "slow" in selection and "not slow" not in selection:
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
