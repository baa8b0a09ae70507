"""The ceiling: the same batches through the model in a loop, no HTTP, no queue.

Two figures: the processor plus the forward (everything the service must do per batch besides
HTTP, decoding and delivery), and the forward alone.
"""

from __future__ import annotations

import base64
import io
import time

import torch
from PIL import Image

from processors import load_adapter


def ceiling(model: str, modality: str, payloads: list[str], batch_size: int, seconds: float = 5.0) -> dict:
    adapter = load_adapter(model, "auto", "auto")
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
    adapter.forward(adapter.preprocess(modality, items))  # warm-up
    batches, preprocess_s, forward_s = 0, 0.0, 0.0
    deadline = time.perf_counter() + seconds
    with torch.inference_mode():
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            prepared = adapter.preprocess(modality, items)
            middle = time.perf_counter()
            adapter.forward(prepared)
            preprocess_s += middle - started
            forward_s += time.perf_counter() - middle
            batches += 1
    requests = batches * batch_size
    return {"batch_size": batch_size, "batches": batches,
            "processor_and_forward_rps": requests / (preprocess_s + forward_s),
            "forward_only_rps": requests / forward_s}
