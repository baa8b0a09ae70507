"""The list of encoder family modules, and the lookups over it.

Adding a family is one new `processors/<family>.py` ending in `FAMILY = Family(...)` and one line in
`FAMILY_MODULES`. A `model_type` no family declares goes to the generic family
(`processors/generic.py`), which serves it only if its rows can be counted exactly and otherwise
refuses at start-up, naming what is missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

import torch

from .base import EncoderAdapter
from .family import Family

FAMILY_MODULES: tuple[str, ...] = (
    "processors.gemma3",
    "processors.llava_onevision",
    "processors.mistral3",
    "processors.generic",
)

FALLBACK_FAMILY = "generic"


@cache
def families() -> tuple[Family, ...]:
    """Every declared family, in `FAMILY_MODULES` order."""
    return tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)


def family_named(name: str) -> Family | None:
    return next((family for family in families() if family.name == name), None)


def family_for_model_type(model_type: str | None) -> Family | None:
    """The family declaring this `model_type`, else the generic fallback."""
    for family in families():
        if model_type in family.model_types:
            return family
    return family_named(FALLBACK_FAMILY)


def builtin_models() -> dict[str, Callable[[torch.device, torch.dtype], EncoderAdapter]]:
    """Built-in model name -> builder, over all families."""
    return {name: build for family in families() for name, build in family.builtins.items()}
