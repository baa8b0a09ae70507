"""Rank 0's side of tensor and data parallelism.

`WorkerGroup` starts the other ranks as processes, feeds them batches of raw request data from one
background sender thread (so the event loop never waits on a socket or a collective), and watches
each process: the moment one exits, a callback tells the service. `TensorParallelAdapter` wraps
rank 0's sharded encoder so that every batch is announced to the other ranks before it is
preprocessed, and every batch, even one rank 0 could not prepare, reaches the layout agreement, so
no rank can wait forever in a collective. `DataParallelReplicas` hands each batch to the
least-loaded live replica, rank 0's own encoder included.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import zmq

from encode_server.models import EncoderAdapter, ItemLayout, PreparedBatch, resolve_device
from encode_server.ops.settings import Settings
from encode_server.parallel.channel import pack_batch, unpack_result
from encode_server.parallel.worker import START_FAILED

log = logging.getLogger("encode_server.parallel.ranks")


def rank_device(settings: Settings, rank: int) -> str:
    """cuda:<rank> for each rank on GPUs; every rank shares the CPU otherwise."""
    base = resolve_device(settings.device)
    return f"cuda:{rank}" if base.type == "cuda" else "cpu"


@dataclasses.dataclass
class WorkerRank:
    """One worker process and how to reach it."""

    rank: int
    process: subprocess.Popen
    batches: zmq.Socket
    alive: bool = True


class WorkerGroup:
    """The worker ranks of one server: processes, their batch channels, and their liveness."""

    def __init__(self, settings: Settings, role: str, size: int) -> None:
        self.settings = settings
        self.role = role
        self.size = size
        self.workers: list[WorkerRank] = []
        self._context = zmq.Context()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._on_death: Callable[[WorkerRank], None] | None = None
        self._results: zmq.Socket | None = None
        self.result_endpoint: str | None = None
        self.dist_init: str | None = None
        self._stopping = False

    # --- start and stop ---------------------------------------------------------------------

    def start(self) -> None:
        """Spawn ranks 1..size-1; they load the model while rank 0 does the same."""
        worker_settings = dataclasses.asdict(self.settings) | {"api_key": None}
        if self.role == "tp":
            with socket_on_loopback() as port:
                self.dist_init = f"tcp://127.0.0.1:{port}"
        else:
            self._results = self._context.socket(zmq.PULL)
            port = self._results.bind_to_random_port("tcp://127.0.0.1")
            self.result_endpoint = f"tcp://127.0.0.1:{port}"
        for rank in range(1, self.size):
            batches = self._context.socket(zmq.PUSH)
            batches.setsockopt(zmq.LINGER, 0)
            port = batches.bind_to_random_port("tcp://127.0.0.1")
            command = [sys.executable, "-m", "encode_server.parallel.worker", "--role", self.role,
                       "--rank", str(rank), "--world-size", str(self.size),
                       "--settings-json", json.dumps(worker_settings),
                       "--batch-endpoint", f"tcp://127.0.0.1:{port}", "--device", rank_device(self.settings, rank)]
            if self.dist_init:
                command += ["--dist-init", self.dist_init]
            if self.result_endpoint:
                command += ["--result-endpoint", self.result_endpoint]
            process = subprocess.Popen(command)
            self.workers.append(WorkerRank(rank, process, batches))
        threading.Thread(target=self._send_loop, name="rank-sender", daemon=True).start()
        for worker in self.workers:
            threading.Thread(target=self._watch, args=(worker,), name=f"rank-{worker.rank}-watch",
                             daemon=True).start()

    def on_death(self, callback: Callable[[WorkerRank], None]) -> None:
        self._on_death = callback
        for worker in self.workers:
            if not worker.alive:
                callback(worker)

    def _watch(self, worker: WorkerRank) -> None:
        code = worker.process.wait()
        worker.alive = False
        # A rank that rank 0 stops is no news, and one whose start failed said why (or rank 0 will, as it
        # meets the same error): one line for one failure.
        if not self._stopping and code != START_FAILED:
            log.error("%s rank %d (pid %d) exited with code %s", self.role, worker.rank, worker.process.pid, code)
        if self._on_death is not None:
            self._on_death(worker)

    def stop(self) -> None:
        self._stopping = True
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.terminate()
        for worker in self.workers:
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
        self._outbox.put(None)

    def ranks(self) -> list[dict[str, Any]]:
        rows = [{"rank": 0, "pid": os.getpid(), "role": self.role, "alive": True}]
        rows += [{"rank": w.rank, "pid": w.process.pid, "role": self.role, "alive": w.alive} for w in self.workers]
        return rows

    # --- batches out, results in ------------------------------------------------------------

    def send_batch(self, worker: WorkerRank, batch_id: int, modality: str, raw_items: Sequence[Any]) -> None:
        """Queue a batch for one worker; the sender thread puts it on the wire."""
        self._outbox.put((worker, pack_batch(batch_id, modality, list(raw_items))))

    def _send_loop(self) -> None:
        while True:
            entry = self._outbox.get()
            if entry is None:
                return
            worker, frames = entry
            if worker.alive:
                worker.batches.send_multipart(frames, copy=False)

    def receive_results(self, deliver: Callable[[int, torch.Tensor | None, list[ItemLayout], str | None],
                                                None]) -> None:
        """Run `deliver` for every replica answer, on a background thread (data parallel only)."""
        assert self._results is not None

        def loop() -> None:
            while True:
                frames = self._results.recv_multipart()
                try:
                    deliver(*unpack_result(frames))
                except (ValueError, KeyError, RuntimeError) as exc:  # never let one bad answer stop the thread
                    log.error("dropping a malformed replica answer: %s", exc)

        threading.Thread(target=loop, name="replica-results", daemon=True).start()


class socket_on_loopback:
    """A free loopback TCP port for torch.distributed's rendezvous."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return self._sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self._sock.close()


# --- tensor parallel ------------------------------------------------------------------------------

def join_tensor_parallel(adapter: EncoderAdapter, group: WorkerGroup) -> TensorParallelAdapter:
    """Rank 0 joins the process group (waits for every rank to load), shards, and wraps the adapter."""
    from encode_server.parallel.tensor_parallel import start_tensor_parallel

    start_tensor_parallel(adapter, rank_device(group.settings, 0), group.dist_init, 0, group.size)
    return TensorParallelAdapter(adapter, group)


class TensorParallelAdapter(EncoderAdapter):
    """Rank 0's sharded encoder: announces each batch to the other ranks and agrees on its layout."""

    def __init__(self, inner: EncoderAdapter, group: WorkerGroup) -> None:
        self.inner = inner
        self.group = group
        self.info, self.device, self.dtype = inner.info, inner.device, inner.dtype
        self.processor = inner.processor  # every rank prepares the batch with its own copy of it
        self._batch_ids = itertools.count()

    def warmup(self) -> None:
        """Nothing: a forward needs every rank; the first health probe warms the whole group."""

    def before_batch(self, modality: str, jobs: Sequence[Any]) -> None:
        batch_id = next(self._batch_ids)
        raw = [item for job in jobs for item in job.raw_items]
        for worker in self.group.workers:
            self.group.send_batch(worker, batch_id, modality, raw)

    def preprocess_failed(self, modality: str, error: BaseException) -> None:
        """Still take part in the batch's layout agreement (with none), or the other ranks would wait."""
        from encode_server.parallel.tensor_parallel import agree_on_layout

        agree_on_layout(None)

    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        from encode_server.parallel.tensor_parallel import agree_on_layout

        agree_on_layout(batch)
        return self.inner.forward(batch)


# --- data parallel --------------------------------------------------------------------------------

class DataParallelReplicas:
    """Picks the least-loaded live replica for each batch; runs remote ones through the channel."""

    def __init__(self, group: WorkerGroup, loop: asyncio.AbstractEventLoop) -> None:
        self.group = group
        self._loop = loop
        self.in_flight = [0] * group.size  # index 0: rank 0's own encoder
        self.ready = [True] + [False] * (group.size - 1)
        self._pending: dict[int, tuple[int, asyncio.Future]] = {}
        self._batch_ids = itertools.count()
        group.receive_results(self._deliver_threadsafe)

    def pick(self) -> int:
        alive = [index for index in range(self.group.size) if self.ready[index] and self._alive(index)]
        return min(alive, key=lambda index: (self.in_flight[index], index))

    @contextlib.contextmanager
    def lease(self) -> Iterator[int]:
        """The least-loaded live replica, counted as busy with one more batch until the block ends."""
        replica = self.pick()
        self.in_flight[replica] += 1
        try:
            yield replica
        finally:
            self.in_flight[replica] -= 1

    def _alive(self, index: int) -> bool:
        return index == 0 or self.group.workers[index - 1].alive

    def _deliver_threadsafe(self, batch_id, rows, layouts, error) -> None:
        self._loop.call_soon_threadsafe(self._deliver, batch_id, rows, layouts, error)

    def _deliver(self, batch_id: int, rows, layouts, error) -> None:
        if batch_id < 0:  # replica -batch_id has loaded its model and is ready
            self.ready[-batch_id] = True
            return
        entry = self._pending.pop(batch_id, None)
        if entry is None or entry[1].done():
            return
        if error is not None:
            entry[1].set_exception(RuntimeError(f"replica {entry[0]} failed the batch: {error}"))
        else:
            entry[1].set_result((rows, layouts))

    def replica_died(self, rank: int) -> None:
        for batch_id, (replica, future) in list(self._pending.items()):
            if replica == rank and not future.done():
                future.set_exception(RuntimeError(f"data-parallel replica {rank} died"))
                self._pending.pop(batch_id, None)

    async def run_remote(self, replica: int, modality: str, jobs: Sequence[Any]) -> tuple[torch.Tensor, list, float]:
        batch_id = next(self._batch_ids)
        future: asyncio.Future = self._loop.create_future()
        self._pending[batch_id] = (replica, future)
        raw = [item for job in jobs for item in job.raw_items]
        started = time.perf_counter()
        self.group.send_batch(self.group.workers[replica - 1], batch_id, modality, raw)
        rows, layouts = await future
        return rows, layouts, time.perf_counter() - started
