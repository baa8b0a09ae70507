"""What the vLLM consumer-side compatibility tools share: the results they report, media they send, and the
rows this server's native `/encode` gives for an item (the reference the consumers' rows must equal)."""

from __future__ import annotations

import base64

#: (step, passed, detail) for each check a tool made, in order.
RESULTS: list[tuple[str, bool, str]] = []


def record(step: str, ok: bool, detail: str = "") -> bool:
    RESULTS.append((step, ok, detail))
    print(f"[{'ok' if ok else 'FAIL'}] {step}{': ' + detail if detail else ''}", flush=True)
    return ok


def png(width: int, height: int, seed: int) -> bytes:
    from tests.support.helpers import png_bytes

    return png_bytes(width, height, seed)


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def native(server, modality: str, item):
    """The rows this server's native `/encode` answers for one item, as a CPU tensor."""
    import httpx
    import torch

    from tests.support.helpers import decode_embedding

    answer = httpx.post(f"{server.url}/encode", json={"req_id": "native", "modality": modality, "mm_items": [item],
                                                      "return_embedding": True}, timeout=120).json()
    return torch.from_numpy(decode_embedding(answer).copy())


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
