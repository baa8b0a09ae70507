"""Shared test helpers: start the real server on a free loopback port, and make media."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import zmq
from PIL import Image

from encode_server.bench.launcher import ServerProcess as _Launcher
from encode_server.bench.launcher import free_port  # noqa: F401 (re-exported for the tests)
from tests.support.paths import NO_TORCHVISION, ROOT  # noqa: F401 (re-exported for the tests)

#: The environment of a subprocess that must run as on a machine without torchvision (tests/support/no_torchvision).
WITHOUT_TORCHVISION = {"PYTHONPATH": str(NO_TORCHVISION)}


def python_module(module: str, *args: str, env: dict[str, str] | None = None,
                  environment: dict[str, str] | None = None, cwd: Path = ROOT, stderr_to_stdout: bool = False):
    """`python -m module *args` as a `subprocess.Popen` in text mode with its output on pipes (stderr apart, or
    with stdout), forked from a zygote for its environment (`tests/support/zygote.py`: the same entry point in a new
    process, without importing torch and transformers again); a new interpreter with `ZYGOTE=0`. `env` is added
    to this process's environment; `environment` replaces it. A `module` that is a `.py` path is run as
    `python SCRIPT *args`."""
    from tests.support.zygote import Zygote

    environment = {**os.environ, **(env or {})} if environment is None else environment
    zygote = Zygote.for_environment(environment)
    if zygote is not None:
        return zygote.start(module, list(args), environment, cwd, stderr_to_stdout)
    command = [module] if module.endswith(".py") else ["-m", module]
    return subprocess.Popen([sys.executable, *command, *args], cwd=cwd, env=environment, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE)


def run_python_module(module: str, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT,
                      timeout: float = 180.0) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)`, through
    `python_module`."""
    process = python_module(module, *args, env=env, cwd=cwd)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


class LineReader:
    """Every line of a process's text stream, collected on a thread; `seen` is set once a line holds `marker`
    (or the stream ends)."""

    def __init__(self, stream, marker: str) -> None:
        import threading

        self.lines: list[str] = []
        self.seen = threading.Event()
        self.marker = marker
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)
            if self.marker in line:
                self.seen.set()
        self.seen.set()

    def text(self) -> str:
        return "".join(self.lines)


def vllm_audio_hash(algorithm: str, model_id: str, samples: np.ndarray) -> str:
    """vLLM 0.33's `MultiModalHasher.hash_kwargs(algorithm, model_id=..., audio=<array>)`
    (`vllm/multimodal/hasher.py`), written out byte by byte for a one-dimensional array: the keys in sorted
    order, each framed (8-byte little-endian length, then the bytes) and followed by its value, tagged (3: a
    leaf, 2: a mapping, 1: a sequence, each container with its length); an array is the leaf
    `{"ndarray": {"dtype", "shape", "data"}}`."""
    import hashlib

    from blake3 import blake3

    def framed(chunk: bytes) -> bytes:
        return len(chunk).to_bytes(8, "little") + chunk

    leaf, mapping, sequence = b"\x03", b"\x02", b"\x01"
    array = (framed(b"ndarray") + mapping + (3).to_bytes(8, "little")
             + framed(b"dtype") + leaf + framed(samples.dtype.str.encode())
             + framed(b"shape") + sequence + (1).to_bytes(8, "little") + leaf + framed(np.array(len(samples)).tobytes())
             + framed(b"data") + leaf + framed(samples.tobytes()))
    stream = framed(b"audio") + leaf + array + framed(b"model_id") + leaf + framed(model_id.encode())
    hasher = {"blake3": blake3, "sha256": hashlib.sha256, "sha512": hashlib.sha512}[algorithm]()
    hasher.update(stream)
    return hasher.hexdigest()


def png_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


def image_b64(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> str:
    return base64.b64encode(png_bytes(width, height, seed, fmt)).decode()


def push(port: int, *messages: list[bytes]) -> None:
    """Send multipart messages to a receiver on this host's loopback with a plain pyzmq PUSH socket."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for frames in messages:
        sock.send_multipart(frames)
    sock.close(linger=2000)


class Pull:
    """A bound PULL socket, as SGLang's tokenizer or scheduler rank binds one (`receive_url`: what a rank
    registers)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        import zmq

        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        if ":" in host:
            self.socket.setsockopt(zmq.IPV6, 1)
        self.port = self.socket.bind_to_random_port(f"tcp://[{host}]" if ":" in host else f"tcp://{host}")
        self.receive_url = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def receive(self, timeout_s: float = 20.0) -> list[bytes]:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError("nothing arrived")
        return self.socket.recv_multipart()

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def rel_diff(a, b) -> float:
    """Largest absolute difference relative to the largest magnitude of the reference `b` (arrays or tensors)."""
    a, b = (np.asarray(x.detach().double() if hasattr(x, "detach") else x, dtype=np.float64) for x in (a, b))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def decode_embedding(response: dict) -> np.ndarray:
    assert response["dtype"] == "float32"
    raw = base64.b64decode(response["embedding"])
    return np.frombuffer(raw, dtype="<f4").reshape(response["embedding_shape"])


class MetricsReader:
    """Reading one sample of a server's `/metrics` (at `self.url`)."""

    url: str

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


class ServerProcess(MetricsReader, _Launcher):
    """The launcher, plus reading one sample of `/metrics`.

    Test servers run with the embedding cache off (`ENCODER_CACHE_BYTES=0`) unless a test turns it on
    with `--cache-bytes` or its own environment: most tests send the same few images again and again to
    exercise batching, deadlines and delivery, which a cache would answer without reaching the encoder.
    """

    def __init__(self, *args: str, env: dict[str, str] | None = None, **kwargs) -> None:
        kwargs.setdefault("cwd", ROOT)
        super().__init__(*args, env={"ENCODER_CACHE_BYTES": "0", **(env or {})}, **kwargs)

    def start_process(self):
        """Forked from this test worker's zygote where it can be (see `python_module`)."""
        if self.python != sys.executable:
            return super().start_process()
        return python_module(self.module, *self.args, environment=self.env, stderr_to_stdout=True)


class InProcessServer(MetricsReader):
    """The same server (settings from the same flags and environment, the same app, uvicorn on a free loopback
    port) run in this process, on a thread: for tests of what the server answers, where a process of its own adds
    nothing but start-up time (importing torch and transformers again). What needs the process (signals and
    draining, exit codes, start-up errors, logs, worker ranks, preprocessing workers) stays with `ServerProcess`.
    The embedding cache is off unless turned on, as there."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 120.0) -> None:
        import os

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--log-level", "warning", *args]
        self.environ = {**os.environ, "ENCODER_CACHE_BYTES": "0", **(env or {})}
        self.startup_timeout = startup_timeout
        self.server = self.thread = None

    def __enter__(self) -> InProcessServer:
        import threading
        import time

        import uvicorn

        from encode_server.http.app import create_app
        from encode_server.ops.settings import load_settings
        from encode_server.runtime import load_encoder

        settings = load_settings(self.args, self.environ)
        if max(settings.tp_size, settings.dp_size) > 1 or settings.preprocess_workers != 0:
            raise ValueError("ranks and preprocessing workers are processes: use ServerProcess")
        adapter, group = load_encoder(settings)
        config = uvicorn.Config(create_app(settings, adapter, group), host=settings.host, port=settings.port,
                                log_level=settings.log_level, timeout_graceful_shutdown=5,
                                timeout_keep_alive=settings.keep_alive_timeout_s)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"server-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the in-process server on port {self.port} did not start")
            time.sleep(0.01)
        response = httpx.get(self.url + "/health", timeout=10.0)
        if response.status_code != 200:
            self.__exit__(None, None, None)
            raise RuntimeError(f"server started but /health says {response.text}")
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
            assert not self.thread.is_alive(), "the in-process server did not stop within 30 s"


BATCHING = ("--max-wait-ms", "500", "--min-batch-size", "100", "--hard-timeout-additional-s", "0.1")


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def embedding_of(body: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"])


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(url + "/encode", json=body) for body in bodies))
