"""The `/encode` response body (docs/CONTRACT.md, section 2): shape, dtype, items, batch size, timings and,
when asked for, the embedding as base64 of its raw little-endian bytes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from encode_server.media import base64_codec as base64
from encode_server.models.dtypes import DTYPE_NAMES, raw_bytes
from encode_server.ops.metrics import ServerMetrics
from encode_server.records import EncodedPart, PartMeta

#: Above this many bytes, base64-encoding an embedding moves off the event loop.
INLINE_ENCODE_LIMIT = 256 * 1024


def b64_embedding(embedding: torch.Tensor) -> str:
    return base64.b64encode(raw_bytes(embedding)).decode("ascii")


async def encode_response(meta: PartMeta, part: EncodedPart, return_embedding: bool, metrics: ServerMetrics,
                          deepstack: int = 0) -> dict[str, Any]:
    """The 200 body for a delivered part (its `timings.transfer` already holds the ZMQ delivery).

    `deepstack` (k > 0 for models such as Qwen3-VL) says each row is `[main] + k deepstack blocks`."""
    embedding = part.embedding
    timings = part.timings
    response: dict[str, Any] = {
        "req_id": meta.req_id,
        "part_idx": meta.part_idx,
        "num_parts": meta.num_parts,
        "modality": meta.modality,
        "embedding_shape": list(embedding.shape),
        "dtype": DTYPE_NAMES[embedding.dtype],
        "items": part.items_json(),
        "batch_size": part.batch_size,
    }
    if deepstack:
        response["deepstack"] = deepstack
    if return_embedding:
        started = time.perf_counter()
        nbytes = embedding.numel() * embedding.element_size()
        if nbytes > INLINE_ENCODE_LIMIT:
            response["embedding"] = await asyncio.to_thread(b64_embedding, embedding)
        else:
            response["embedding"] = b64_embedding(embedding)
        inline_s = time.perf_counter() - started
        timings = timings.with_transfer(timings.transfer + inline_s * 1e3)
        metrics.transfer.labels(meta.modality).observe(inline_s)
        metrics.bytes_sent.inc(nbytes)
    response["timings_ms"] = timings.as_json()
    return response
