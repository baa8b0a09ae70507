"""The port is taken before the model loads: a busy `--port` stops the real server at once (exit 1, one line
naming the port and `--port`/`ENCODER_PORT`), with no model resolved or loaded and no rank started; and the
sockets opened early are the ones that serve."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from encode_server.http.listen import ListenError, open_listeners
from tests.support.helpers import ServerProcess, free_port, run_python_module


@pytest.fixture
def busy_port():
    """A port on 127.0.0.1 that something else listens on."""
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        yield occupant.getsockname()[1]


@pytest.mark.parametrize("extra", [(), ("--dp-size", "2")], ids=["single", "data-parallel"])
def test_a_busy_port_exits_1_with_one_line_before_the_model_loads(busy_port, extra):
    assert run_python_module("encode_server", "--version", timeout=120).returncode == 0  # the zygote is up
    started = time.monotonic()
    done = run_python_module("encode_server", "--host", "127.0.0.1", "--port", str(busy_port),
                             "--log-level", "info", *extra, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("encode-server")]
    assert lines == [f"encode-server: port {busy_port} is already in use on 127.0.0.1: stop what listens there "
                     "or choose another port with --port (or ENCODER_PORT)"], done.stderr
    # Nothing of the start-up ran: no model resolved or loaded, no rank started (they log at INFO).
    assert "resolving model" not in done.stderr and "loading model" not in done.stderr, done.stderr
    assert "ranks" not in done.stderr, done.stderr
    assert elapsed < 10, elapsed  # a fork, the flags and a bind (a model load and warm-up take longer)


def test_the_early_sockets_are_the_ones_that_serve():
    """The server answers on the port it took at start-up, and holds it: a second bind there fails."""
    with ServerProcess() as server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        with pytest.raises(ListenError, match=f"port {server.port} is already in use"):
            open_listeners("127.0.0.1", server.port)


def test_open_listeners_refuses_a_busy_port_and_closes_what_it_opened(busy_port):
    with pytest.raises(ListenError, match="--port .or ENCODER_PORT."):
        open_listeners("127.0.0.1", busy_port)
    port = free_port()
    sockets = open_listeners("127.0.0.1", port)
    try:
        assert [sock.getsockname() for sock in sockets] == [("127.0.0.1", port)]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening already: the kernel queues the connection until the server accepts
    finally:
        for sock in sockets:
            sock.close()


def test_port_0_takes_one_free_port_for_every_address():
    sockets = open_listeners("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(ports) == 1 and 0 not in ports
    finally:
        for sock in sockets:
            sock.close()

