"""One preprocessing worker as the pool's conductor sees it (`preprocessing.pool.PreprocessPool`).

A `WorkerHandle` is a worker's place in the pool: the process in it changes on restarts (each a new
generation, with new shared-memory slots), its pipes, the item it holds, and its counters. It knows
how to start its process, tell it the next task, reap it when it dies (and say why), and stop it;
deciding what to do about a death (retry the item, restart, give up) is the pool's business.

Workers start from multiprocessing's fork server (`worker_context`), which imports torch, transformers
and the modules the adapter's processor needs once: a worker then starts in a fraction of a second instead of
importing them again (seconds of CPU per worker at start-up and on every restart after a crash), and its
pages of those modules are shared with the other workers.
"""

from __future__ import annotations

import io
import multiprocessing
import multiprocessing.context
import pickle
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from encode_server.preprocessing.shared_tensors import SHM_DIR, SlotReader
from encode_server.preprocessing.worker import worker_main


def worker_context(processor: Any) -> multiprocessing.context.BaseContext:
    """The context workers start in: a fork server that has preloaded the worker's module and every module
    unpickling `processor` imports (its family's processor, the `transformers` classes it holds, torch). The
    fork server is one per process and started on first use: the preload is set by the first pool and later ones
    share it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["encode_server.preprocessing.worker", *modules_pickled_in(processor)])
    return context


def modules_pickled_in(value: Any) -> list[str]:
    """The modules that unpickling `value` imports: those defining the classes and functions it refers to."""
    modules: set[str] = set()

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            owner = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
            module = getattr(owner, "__module__", None)
            if isinstance(module, str):
                modules.add(module)
            return NotImplemented

    Recorder(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return sorted(module for module in modules if module != "__main__")


@dataclass
class WorkerHandle:
    """The conductor's record of one worker place (the process in it changes on restarts)."""

    index: int
    process: Any = None
    tasks: Any = None  # the pool's sending end
    results: Any = None  # the pool's receiving end
    ready: bool = False
    task: Any = None  # the item it holds (the pool's task record)
    task_started: float = 0.0
    start_failures: int = 0
    restarts: int = 0
    busy_s: float = 0.0  # wall seconds spent on items, as the worker measured them
    cpu_s: float = 0.0  # CPU seconds spent on items
    items: int = 0
    slot_items: int = 0  # items that came back in a reusable slot (the others: one-off blocks or the pipe)
    ahead_items: int = 0  # items it took as spare work (queued requests prepared ahead of their batch)
    generation: int = 0
    slots: SlotReader = field(default_factory=SlotReader)  # this generation's slots, mapped here
    released: list[int] = field(default_factory=list)  # slots to give back with its next task
    pending_restart_at: float | None = None
    gave_up: bool = False  # failed to start `max_start_failures` times in a row: never restarted
    exit_reasons: list[str] = field(default_factory=list)

    def block_prefix(self, pool_prefix: str) -> str:
        """Where this generation's shared-memory files are named."""
        return f"{pool_prefix}-w{self.index}g{self.generation}"

    def start(self, context, processor: Any, limits: Any, pool_prefix: str, threads: int) -> None:
        """Start this generation's process (the caller has moved `generation` on)."""
        task_receiver, task_sender = context.Pipe(duplex=False)
        result_receiver, result_sender = context.Pipe(duplex=False)
        self.slots = SlotReader()
        process = context.Process(
            target=worker_main, name=f"preprocess-worker-{self.index}", daemon=True,
            args=(self.index, processor, limits, task_receiver, result_sender, self.block_prefix(pool_prefix),
                  threads))
        process.start()
        task_receiver.close()  # the worker's ends: once closed here, its death reads as EOF
        result_sender.close()
        self.process, self.tasks, self.results = process, task_sender, result_receiver
        self.ready, self.task, self.pending_restart_at = False, None, None

    def reap(self, pool_prefix: str) -> str:
        """The process has exited or is exiting (its sentinel or pipe said so): collect it, remove the
        blocks it wrote but never announced, close the pipes; returns why it ended."""
        process = self.process
        process.join(10.0)
        code = process.exitcode
        if code is None:
            reason = "stopped answering (its pipe closed)"
        elif code < 0:
            reason = f"killed by {signal.Signals(-code).name}"
        else:
            reason = f"exited with code {code}"
        for path in SHM_DIR.glob(Path(self.block_prefix(pool_prefix) + "-*").name):
            path.unlink(missing_ok=True)
        for conn in (self.tasks, self.results):
            conn.close()
        self.process = None
        self.ready = False
        return reason

    def ask_to_stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            try:
                self.tasks.send(None)
            except (BrokenPipeError, OSError):
                pass

    def stop(self, deadline: float) -> None:
        """Wait for the process until `deadline` (after `ask_to_stop`), then kill it; close the pipes."""
        if self.process is None:
            return
        self.process.join(max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        for conn in (self.tasks, self.results):
            try:
                conn.close()
            except OSError:
                pass
        self.process = None

    def stats(self, wall: float) -> dict[str, float]:
        return {"worker": self.index, "items": self.items, "slot_items": self.slot_items,
                "ahead_items": self.ahead_items, "busy_s": self.busy_s,
                "cpu_s": self.cpu_s, "busy_fraction": self.busy_s / wall, "cpu_fraction": self.cpu_s / wall,
                "restarts": self.restarts}
