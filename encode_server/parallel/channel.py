"""What rank 0 sends its workers, and what data-parallel replicas send back (no pickle).

A batch travels as the raw request data, not tensors: frame 0 is a JSON header (batch number,
modality, and per item either one file or a list of frames), then one frame of raw bytes per file
or frame. Every rank decodes and preprocesses for itself. A replica's answer is a JSON header
(batch number, item layouts, dtype, shape or an error) and the rows' raw bytes.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from encode_server.models import ItemLayout
from encode_server.models.dtypes import DTYPE_NAMES, DTYPES, raw_bytes, storage_dtype


def pack_batch(batch_id: int, modality: str, raw_items: list[bytes | list[bytes]]) -> list[bytes]:
    shapes = [len(item) if isinstance(item, list) else None for item in raw_items]
    frames = [json.dumps({"batch": batch_id, "modality": modality, "frames": shapes}).encode()]
    for item in raw_items:
        frames.extend(item if isinstance(item, list) else [item])
    return frames


def unpack_batch(frames: list[bytes]) -> tuple[int, str, list[bytes | list[bytes]]]:
    header = json.loads(frames[0])
    items: list[bytes | list[bytes]] = []
    cursor = 1
    for count in header["frames"]:
        if count is None:
            items.append(bytes(frames[cursor]))
            cursor += 1
        else:
            items.append([bytes(f) for f in frames[cursor:cursor + count]])
            cursor += count
    return header["batch"], header["modality"], items


def pack_result(batch_id: int, rows: torch.Tensor | None, layouts: list[ItemLayout],
                error: str | None = None) -> list[Any]:
    header: dict[str, Any] = {"batch": batch_id, "error": error,
                              "layouts": [[layout.tokens, *layout.grid_thw] for layout in layouts]}
    if rows is None:
        return [json.dumps(header).encode(), b""]
    header.update(dtype=DTYPE_NAMES[rows.dtype], shape=list(rows.shape))
    return [json.dumps(header).encode(), raw_bytes(rows)]


def unpack_result(frames: list[bytes]) -> tuple[int, torch.Tensor | None, list[ItemLayout], str | None]:
    header = json.loads(frames[0])
    layouts = [ItemLayout(tokens=t, grid_thw=(a, b, c)) for t, a, b, c in header["layouts"]]
    if header["error"] is not None or "dtype" not in header:  # an error, or a replica saying it is ready
        return header["batch"], None, layouts, header["error"]
    dtype = DTYPES[header["dtype"]]
    rows = torch.frombuffer(bytearray(frames[1]), dtype=storage_dtype(dtype)).reshape(header["shape"])
    return header["batch"], rows.view(dtype), layouts, None
