"""The user-facing scripts run as the README says, with only the server's own dependencies."""

from __future__ import annotations

import subprocess
import sys

from tests.support.helpers import ROOT, InProcessServer

#: Runs a script with `httpx` unimportable (it is only in the test extra).
WITHOUT_HTTPX = ("import runpy, sys; sys.modules['httpx'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_demo_prefill_runs_without_httpx():
    with InProcessServer() as server:
        done = subprocess.run([sys.executable, "-c", WITHOUT_HTTPX, str(ROOT / "scripts" / "demo_prefill.py"),
                               "--url", server.url], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "both ranks hold identical bytes" in done.stdout
    assert done.stdout.count("via embedding_port") == 2

