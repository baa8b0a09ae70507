"""Shared test helpers: start the real server on a free loopback port, and make media."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def png_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


def image_b64(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> str:
    return base64.b64encode(png_bytes(width, height, seed, fmt)).decode()


def decode_embedding(response: dict) -> np.ndarray:
    assert response["dtype"] == "float32"
    raw = base64.b64decode(response["embedding"])
    return np.frombuffer(raw, dtype="<f4").reshape(response["embedding_shape"])


class ServerProcess:
    """`python -m encode_server` in a subprocess on a free port; stopped on exit."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--log-level", "warning", *args]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    def __enter__(self) -> ServerProcess:
        import tempfile

        log = tempfile.NamedTemporaryFile("w+", prefix="encode-server-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "encode_server", *self.args], cwd=ROOT, env=self.env,
            stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

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

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of `/metrics` (0 when absent)."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            sample, _, label_text = head.partition("{")
            if sample != name:
                continue
            found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if "=" in part)
            if all(found.get(key, "").strip('"') == want for key, want in labels.items()):
                return float(value)
        return 0.0
