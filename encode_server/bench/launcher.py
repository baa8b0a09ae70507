"""Start `encode-server` (or any command serving HTTP) in a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from encode_server.ops.logs import READY_LINE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m encode_server` in a subprocess on a free port; stopped on exit."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 120.0,
                 module: str = "encode_server", python: str | None = None,
                 cwd: str | Path | None = None) -> None:
        self.port = free_port()
        self.python = python or sys.executable  # another interpreter: a server from another environment
        self.url = f"http://127.0.0.1:{self.port}"
        self.module = module
        self.cwd = cwd  # None: this process's
        self.args = ["--port", str(self.port), "--log-level", "warning", *args]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> ServerProcess:
        log = tempfile.NamedTemporaryFile("w+", prefix="encode-server-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.proc = self.start_process()
        ready, ready_line_seen = threading.Event(), threading.Event()

        def copy_output() -> None:
            """Copy the child's output to the log file; signal on its ready line or its exit."""
            with open(self.log_path, "a") as sink:
                for line in self.proc.stdout:
                    sink.write(line)
                    sink.flush()
                    if READY_LINE in line:  # a plain line, or a JSON record's message (--log-format json)
                        ready_line_seen.set()
                        ready.set()
            ready.set()

        threading.Thread(target=copy_output, name=f"server-{self.port}-output", daemon=True).start()
        if not ready.wait(self.startup_timeout):
            self.__exit__(None, None, None)
            raise RuntimeError(f"server did not start within {self.startup_timeout:g} s:\n{self.log()}")
        if not ready_line_seen.is_set():  # its output ended without the ready line: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
            raise RuntimeError(f"server exited with {self.proc.poll()} before it was ready:\n{self.log()}")
        try:
            response = httpx.get(self.url + "/health", timeout=10.0)
        except httpx.HTTPError as exc:
            self.__exit__(None, None, None)
            raise RuntimeError(f"server said it was ready but /health failed ({exc!r}):\n{self.log()}") from None
        if response.status_code != 200:
            self.__exit__(None, None, None)
            raise RuntimeError(f"server started but /health says {response.text}:\n{self.log()}")
        return self

    def start_process(self) -> subprocess.Popen:
        """`python -m MODULE ARGS` with this environment, its output (stdout and stderr) on a pipe."""
        return subprocess.Popen([self.python, "-m", self.module, *self.args], cwd=self.cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
