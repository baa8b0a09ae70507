"""Encoder families behind one adapter interface; `load_adapter` picks one by name or folder.

Each family is one module declaring a `Family` (`processors/family.py`); `processors/registry.py`
lists them. `BUILTIN_MODELS` (built-in tiny model name -> builder) is gathered from the registry on
first use, so importing this package stays cheap.
"""

from __future__ import annotations

from typing import Any

from .base import (
    DeviceError,
    EncoderAdapter,
    ItemError,
    ItemLayout,
    ModelInfo,
    PreparedBatch,
    resolve_device,
    resolve_dtype,
)
from .dtypes import DTYPE_NAMES

__all__ = ["DTYPE_NAMES", "DeviceError", "EncoderAdapter", "ItemError", "ItemLayout", "ModelInfo", "PreparedBatch",
           "load_adapter", "BUILTIN_MODELS"]


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_MODELS":
        from .registry import builtin_models

        return builtin_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_adapter(model: str, device: str = "auto", dtype: str = "auto") -> EncoderAdapter:
    """The encoder for a built-in model name or a local Hugging Face checkpoint folder."""
    from pathlib import Path

    from .registry import ModelNotFound, builtin_models, load_checkpoint, model_not_found_message

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    builtins = builtin_models()
    builder = builtins.get(model)
    if builder is not None:
        return builder(torch_device, torch_dtype)
    if Path(model).expanduser().is_dir():
        return load_checkpoint(model, torch_device, torch_dtype)
    raise ModelNotFound(model_not_found_message(model))
