"""Items handed to a processor inside a chat request, for processors that take media only through their
`apply_chat_template` (Voxtral's: its `__call__` refuses audio, and its tokenizer, `mistral_common`'s, writes the
audio tokens and pads the clip itself).

The item goes in as the content of one user message, encoded as a file would be (an audio clip as a float32
WAV at the extractor's rate, which `mistral_common` reads back sample for sample; an image as PNG), and the
processor's own `apply_chat_template(tokenize=True, return_dict=True)` gives the ids and features, as a
monolithic server that receives the same message computes them. The generic path's probe tries this form
last (`encode_server/models/generic/probes.py`).
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np


class ChatRequestPrompt(str):
    """The prompt form "the item alone in a user message, through the processor's chat request"."""


CHAT_REQUEST = ChatRequestPrompt("<the item in a chat request>")


def item_content(modality: str, item: Any, sampling_rate: int) -> dict[str, str]:
    """One message content part holding the item as base64 file bytes."""
    buffer = io.BytesIO()
    if modality == "audio":
        import soundfile

        soundfile.write(buffer, np.asarray(item, dtype=np.float32), sampling_rate, format="WAV", subtype="FLOAT")
    elif modality == "image":
        item.save(buffer, "PNG")
    else:
        raise ValueError(f"a chat request carries no {modality} item here")
    return {"type": modality, "base64": base64.b64encode(buffer.getvalue()).decode("ascii")}


def chat_request_inputs(processor: Any, modality: str, item: Any, sampling_rate: int) -> dict[str, Any]:
    """The processor's inputs for one item alone in a user message."""
    conversation = [{"role": "user", "content": [item_content(modality, item, sampling_rate)]}]
    return dict(processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt"))
