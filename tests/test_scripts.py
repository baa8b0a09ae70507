"""The user-facing scripts run as the README says, with only the server's own dependencies."""

from __future__ import annotations

import subprocess
import sys

from .helpers import ROOT, InProcessServer

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


def test_bounded_loop_experiment_hands_out_a_few_ready_sockets_per_iteration():
    """`scripts/bounded_loop_server.py` (the event-loop experiment in docs/BENCHMARKS.md): of 10 ready
    sockets, each select returns at most `EVENTS_PER_POLL`, and successive selects reach all of them."""
    import selectors
    import socket

    from scripts.bounded_loop_server import EVENTS_PER_POLL, BoundedEpollSelector

    pairs = [socket.socketpair() for _ in range(10)]
    selector = BoundedEpollSelector()
    try:
        for reader, writer in pairs:
            selector.register(reader, selectors.EVENT_READ)
            writer.send(b"x")  # every reader is ready, and stays ready until read
        seen: set[int] = set()
        for _ in range(10):
            ready = selector.select(0)
            assert 0 < len(ready) <= EVENTS_PER_POLL
            for key, _events in ready:
                seen.add(key.fd)
                key.fileobj.recv(1)
                selector.unregister(key.fileobj)
            if len(seen) == len(pairs):
                break
        assert seen == {reader.fileno() for reader, _ in pairs}
    finally:
        selector.close()
        for reader, writer in pairs:
            reader.close()
            writer.close()
