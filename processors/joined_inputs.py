"""Per-item processor outputs joined into one batch: each tensor concatenated on its first dimension, where the
items' tensors have the same dtypes and trailing dimensions (the generic path batches items this way where its
start-up probe showed that a joined forward gives each item's rows alone)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from processors.base import ItemLayout


def join_signature(inputs: dict[str, Any]) -> tuple | None:
    """What must match for items' inputs to join: each key's dtype and trailing dimensions (None: a value that
    is not a tensor with a first dimension, so the item runs alone)."""
    signature = []
    for key, value in sorted(inputs.items()):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        signature.append((key, value.dtype, tuple(value.shape[1:])))
    return tuple(signature)


def joined_inputs(items: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-item processor outputs as one batch (each tensor concatenated on its first dimension), or None where
    they do not join."""
    signature = join_signature(items[0])
    if signature is None or any(join_signature(item) != signature for item in items[1:]):
        return None
    return {key: torch.cat([item[key] for item in items]) for key in items[0]}


def joinable_runs(items: list[tuple[dict[str, Any], ItemLayout]]) -> list[list[tuple[dict[str, Any], ItemLayout]]]:
    """Consecutive items grouped while their inputs join into one batch."""
    runs: list[list[tuple[dict[str, Any], ItemLayout]]] = []
    signatures: list[tuple | None] = []
    for item in items:
        signature = join_signature(item[0])
        if runs and signature is not None and signature == signatures[-1]:
            runs[-1].append(item)
        else:
            runs.append([item])
            signatures.append(signature)
    return runs
