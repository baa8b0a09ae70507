"""What a preprocessing worker process does (started by `preprocessing.pool.PreprocessPool` from its fork server).

A worker holds the adapter's processor (`processors.Processor`: no model) and one torch thread. For each task (one
item's raw bytes and modality) it decodes the item with the functions and limits of `media/decoding.py` (as
the server's own decode threads do), checks its layout, runs the family's `preprocess` on it alone, and sends the
tensors back through shared memory (`preprocessing/shared_tensors.py`): never the pixels through the pipe. It keeps
a few reusable slots for that (`SlotWriter`); a task carries the slots the pool has released since the
worker's last task, and an item that finds no free slot goes in a one-off block.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from encode_server.media.decoding import MediaLimits
from encode_server.preprocessing.shared_tensors import SlotWriter, export_tensors
from processors.base import PreparedBatch, Processor, new_pixels, pixels_allocated_by

log = logging.getLogger("encode_server.preprocessing.worker")


def prepare_item(processor: Processor, limits: MediaLimits, modality: str, raw: bytes | list[bytes],
                 location: str) -> PreparedBatch:
    """Decode one item's bytes and run the processor's `preprocess` on it alone (what a worker does)."""
    from encode_server.media.decoding import MediaError, decode_bytes, decode_frames
    from processors.base import ItemError

    if isinstance(raw, list):
        item = decode_frames(raw, limits, location)
    else:
        item = decode_bytes(modality, raw, limits, location)
    try:
        layout = processor.item_layout(modality, item)
    except ItemError as exc:
        raise MediaError(location, str(exc)) from None
    prepared = processor.preprocess(modality, [item])
    if prepared.layouts != [layout]:
        raise RuntimeError(f"{location}: the processor's grid {prepared.layouts} differs from the item's layout "
                           f"{layout}")
    return prepared


def _one_slot(slots: SlotWriter):
    """An allocator for one task's pixel rows: the first call gets float32 rows inside a free slot (so that
    sending them copies nothing), any later call a new tensor, so two outputs never share the slot."""
    calls = itertools.count()

    def allocate(shape: tuple[int, int]) -> torch.Tensor:
        view = slots.reserve(shape[0] * shape[1] * 4) if next(calls) == 0 else None
        return new_pixels(shape) if view is None else view.view(torch.float32).view(shape)

    return allocate


def worker_main(index: int, processor: Processor, limits: MediaLimits, tasks, results, block_prefix: str,
                 threads: int) -> None:
    """A worker process: warm up, say ready, then prepare one task at a time until told to stop."""
    from encode_server.media.decoding import MediaError
    from encode_server.parallel.worker import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains on SIGINT; it stops workers itself
    torch.set_num_threads(threads)
    from encode_server.ops.logs import configure_logging

    configure_logging("warning", process=f"preprocess-worker{index}")
    try:
        modality, sample = processor.sample_encoded()
        prepare_item(processor, limits, modality, sample, "warm-up")
    except Exception as exc:
        results.send(("broken", os.getpid(), f"{type(exc).__name__}: {exc}", None))
        return
    results.send(("ready", os.getpid(), "", None))
    inline_fallback = False
    slots = SlotWriter(block_prefix)
    for sequence in itertools.count():
        try:
            task = tasks.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        task_id, modality, raw, location, released = task
        slots.release(released)
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            with pixels_allocated_by(_one_slot(slots)):
                prepared = prepare_item(processor, limits, modality, raw, location)
            inputs: Any
            try:
                inputs = (slots.write(prepared.inputs)
                          or export_tensors(prepared.inputs, Path(f"{block_prefix}-{sequence}")))
            except OSError as exc:  # /dev/shm full or missing: correct but slower, through the pipe
                if not inline_fallback:
                    log.warning("shared memory unavailable (%s): sending tensors through the pipe", exc)
                    inline_fallback = True
                inputs = prepared.inputs
            timings = (time.perf_counter() - started, time.process_time() - cpu_started)
            message = ("done", task_id, (inputs, prepared.layouts, prepared.extras), timings)
        except (MediaError, ValueError) as exc:  # encode_server.models.ItemError is a ValueError
            message = ("failed", task_id, (400, str(exc)), None)
        except Exception as exc:
            message = ("failed", task_id, (500, f"{location}: preprocessing failed: {type(exc).__name__}: {exc}"),
                       None)
        try:
            results.send(message)
        except (BrokenPipeError, OSError):
            return
