"""What one encoder family declares about itself; `registry.py` lists the families."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter


@dataclass(frozen=True)
class Family:
    """Everything the server needs to know about one encoder family, declared in its own module."""

    name: str  # the family's name in /server_info, e.g. "qwen2_5_vl"
    model_types: tuple[str, ...]  # config.json `model_type` values this module serves
    modalities: tuple[str, ...]  # e.g. ("image", "video")
    row_formula: str  # one line for the README: how many rows an item yields
    grid_thw: str  # one line for the README: what `grid_thw` reports for an item
    load: Callable[[Path, torch.device, torch.dtype], EncoderAdapter]  # from a checkpoint folder
    builtins: Mapping[str, Callable[[torch.device, torch.dtype], EncoderAdapter]] = field(default_factory=dict)
    shard: Callable[[EncoderAdapter, Any], None] | None = None  # tensor-parallel plan (adapter, DeviceMesh);
    # None: no plan, and --tp-size > 1 is refused at start-up with a clear message
