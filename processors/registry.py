"""The list of encoder families (one module each) and lookups over it.

Adding a family = one new module under `processors/` that ends with `FAMILY = Family(...)`, and one
line in `FAMILY_MODULES`. Modules are imported on first lookup; importing them is cheap (their heavy
`transformers` imports live inside functions).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

import torch

from .base import EncoderAdapter
from .family import Family

FAMILY_MODULES: tuple[str, ...] = (
    "processors.qwen3_vl",
    "processors.glm4v",
)


@cache
def families() -> tuple[Family, ...]:
    """Every family, in `FAMILY_MODULES` order."""
    return tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)


def family_for_model_type(model_type: str | None) -> Family | None:
    """The family that serves a checkpoint's `config.json` `model_type`, or None."""
    return next((family for family in families() if model_type in family.model_types), None)


def family_named(name: str) -> Family | None:
    """The family called `name` (as `/server_info` says it), or None."""
    return next((family for family in families() if family.name == name), None)


def builtin_models() -> dict[str, Callable[[torch.device, torch.dtype], EncoderAdapter]]:
    """Built-in model name -> builder, over every family."""
    return {name: build for family in families() for name, build in family.builtins.items()}
