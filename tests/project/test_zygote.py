"""The test zygote (`tests/support/zygote.py`) starts processes that behave as new interpreters do: the same output and
exit status, the variables of their own environment, signals delivered to them, and none outliving it."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from tests.support.helpers import ServerProcess, python_module, run_python_module
from tests.support.zygote import ForkedProcess, Zygote


@pytest.mark.parametrize("args", [("--no-such-flag",), ("--model", "no-such-model", "--port", "0")])
def test_a_forked_start_fails_as_a_new_interpreter_does(args, monkeypatch):
    forked = run_python_module("encode_server", *args)
    monkeypatch.setenv("ZYGOTE", "0")
    fresh = run_python_module("encode_server", *args)
    assert forked.returncode == fresh.returncode != 0
    assert without_times(forked.stderr) == without_times(fresh.stderr) and forked.stdout == fresh.stdout
    assert "no-such-" in forked.stderr


def without_times(log: str) -> str:
    return re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", log, flags=re.MULTILINE)


def test_a_forked_server_reads_its_own_variables_and_dies_by_the_signal_sent():
    with ServerProcess(env={"ENCODER_API_KEY": "k3y"}) as server:
        assert isinstance(server.proc, ForkedProcess)
        assert httpx.post(server.url + "/encode", json={}).status_code == 401  # the key of its environment
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(30) == -signal.SIGKILL


def test_another_environment_gets_its_own_zygote_and_its_processes_die_with_it():
    environment = {**os.environ, "HF_HUB_OFFLINE": "0"}
    zygote = Zygote.for_environment(environment)
    assert zygote is not Zygote.for_environment(dict(os.environ))
    process = python_module("encode_server", "--port", "0", "--log-level", "warning", environment=environment,
                            stderr_to_stdout=True)
    assert process.stdout.readline().startswith("encode-server ready:")
    zygote.stop()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running(process.pid):
        time.sleep(0.05)
    assert not running(process.pid)


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie waiting to be reaped has)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
