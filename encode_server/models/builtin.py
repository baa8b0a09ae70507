"""The fixed-seed construction behind every built-in tiny model (each family declares its own).

Built-in models are real `transformers` encoder architectures from small configs: they need no
download, and two processes (or two ranks) that build the same name hold bit-identical weights,
because the weights come from `torch.manual_seed(BUILTIN_SEED)` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

BUILTIN_SEED = 1234

T = TypeVar("T")


def seeded(build: Callable[[], T]) -> T:
    """Build modules on the CPU from a fixed seed, without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        return build()
