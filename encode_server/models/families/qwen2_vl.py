"""The qwen2_vl family: Qwen2-VL's vision tower and merger (`Qwen2VisionTransformerPretrainedModel`).

Qwen2-VL has the grid, processors and tower interface of Qwen2.5-VL (`families/qwen2_5_vl.py`, whose
loader this module reuses): an image is a `1 x gh x gw` patch grid, a video `t x gh x gw` with
`temporal_patch_size` frames per temporal patch, and every `merge^2` patches become one row. The tower
attends within each image or video only (no windows), so an item's rows do not depend on its batch
neighbours. Its blocks have a fused `qkv` and a two-layer MLP (`fc1`, `fc2`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter
from encode_server.models.families.qwen2_5_vl import load_qwen_vision
from encode_server.models.family import Family
from encode_server.models.towers.grid_vision import shard_grid_blocks


def qwen2_vl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The vision tower and merger of a Qwen2-VL checkpoint."""
    return load_qwen_vision(folder, device, dtype, "qwen2_vl")


def shard_qwen2_vl(adapter: EncoderAdapter, mesh: Any) -> None:
    shard_grid_blocks(adapter, mesh, colwise_mlp=("fc1",), rowwise_mlp=("fc2",))


FAMILY = Family(
    name="qwen2_vl",
    model_types=("qwen2_vl",),
    modalities=("image", "video"),
    row_formula="`t*h*w / merge^2`",
    grid_thw="the tower's patch grid; `t` = 1 for an image, frames / temporal patch for a video (last frame repeated)",
    load=qwen2_vl_from_folder,
    shard=shard_qwen2_vl,
)
