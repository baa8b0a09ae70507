"""What vLLM's EPD proxy sends the producer (`POST /v1/chat/completions` bodies and their parts), and the
native rows of the same item from the server, to compare what the producer stored with."""

from __future__ import annotations

import base64
import io

import httpx
import torch
from PIL import Image

from tests.support.helpers import decode_embedding

CONSUMER_MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"  # one of the golden model ids


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def proxy_body(*parts: dict) -> dict:
    """What disagg_epd_proxy.py sends its encoder: the user's body, max_tokens 1, not streamed."""
    return {"model": "Qwen/Qwen2.5-VL-3B-Instruct", "max_tokens": 1, "stream": False,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]}


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def media_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def native_rows_of(server, modality: str, item) -> torch.Tensor:
    response = httpx.post(f"{server.url}/encode", json={"req_id": "reference", "modality": modality,
                                                        "mm_items": [item], "return_embedding": True}, timeout=60)
    assert response.status_code == 200, response.text
    return torch.from_numpy(decode_embedding(response.json()).copy())


def frames_item(frames) -> dict:
    out = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, "PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode())
    return {"frames": out}
