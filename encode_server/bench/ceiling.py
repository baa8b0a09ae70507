"""The ceiling: the same batches through the model in a loop, no HTTP, no queue.

Two figures: the processor plus the forward (everything the service must do per batch besides
HTTP, decoding and delivery), and the forward alone. torch runs on as many threads as the server's
would (`--cpu-threads`' rule: half the cores on a CPU by default), or a bound measured with torch's own
default (every core, its OpenMP threads spinning) can fall below the service it bounds.
"""

from __future__ import annotations

import io
import time

import torch
from PIL import Image

from encode_server.__main__ import set_cpu_threads
from encode_server.media import base64_codec as base64  # the service's decoder: the ceiling does what it does
from encode_server.models import load_adapter
from encode_server.ops.settings import Settings


def ceiling(model: str, modality: str, payloads: list[str], batch_size: int, seconds: float = 5.0,
            settings: Settings | None = None) -> dict:
    """`settings`: those of the server being bounded (its `--cpu-threads`); the defaults by default."""
    settings = settings or Settings()
    adapter = load_adapter(model, "auto", "auto")
    threads = torch.get_num_threads()
    set_cpu_threads(settings, 1)
    try:
        return {**_measure(adapter, modality, payloads, batch_size, seconds), "threads": torch.get_num_threads()}
    finally:
        torch.set_num_threads(threads)


def _measure(adapter, modality: str, payloads: list[str], batch_size: int, seconds: float) -> dict:
    items = []
    for payload in payloads[:batch_size] * (1 + batch_size // max(1, len(payloads))):
        data = base64.b64decode(payload)
        if modality == "audio":
            import soundfile

            wave, _ = soundfile.read(io.BytesIO(data), dtype="float32")
            items.append(wave)
        else:
            items.append(Image.open(io.BytesIO(data)).convert("RGB"))
    items = items[:batch_size]
    adapter.forward(adapter.processor.preprocess(modality, items))  # warm-up
    batches, preprocess_s, forward_s = 0, 0.0, 0.0
    deadline = time.perf_counter() + seconds
    with torch.inference_mode():
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            prepared = adapter.processor.preprocess(modality, items)
            middle = time.perf_counter()
            adapter.forward(prepared)
            preprocess_s += middle - started
            forward_s += time.perf_counter() - middle
            batches += 1
    requests = batches * batch_size
    return {"batch_size": batch_size, "batches": batches,
            "processor_and_forward_rps": requests / (preprocess_s + forward_s),
            "forward_only_rps": requests / forward_s}
