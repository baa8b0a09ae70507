"""Encoder families behind one adapter interface; `load_adapter` picks one by name or folder."""

from __future__ import annotations

from .base import (
    EncoderAdapter,
    ItemError,
    ItemLayout,
    ModelInfo,
    PreparedBatch,
    resolve_device,
    resolve_dtype,
)
from .builtin import BUILTIN_MODELS
from .dtypes import DTYPE_NAMES

__all__ = ["DTYPE_NAMES", "EncoderAdapter", "ItemError", "ItemLayout", "ModelInfo", "PreparedBatch", "load_adapter",
           "BUILTIN_MODELS"]


def load_adapter(model: str, device: str = "auto", dtype: str = "auto") -> EncoderAdapter:
    """The encoder for a built-in model name or a local Hugging Face checkpoint folder."""
    from pathlib import Path

    from .checkpoint import CheckpointError, load_checkpoint

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    builder = BUILTIN_MODELS.get(model)
    if builder is not None:
        return builder(torch_device, torch_dtype)
    if Path(model).expanduser().is_dir():
        return load_checkpoint(model, torch_device, torch_dtype)
    known = ", ".join(sorted(BUILTIN_MODELS))
    raise CheckpointError(f"unknown model {model!r}: expected a built-in name ({known}) or a checkpoint folder")
