"""Helpers the families' tensor-parallel plans share: head checks and fused-qkv reordering."""

from __future__ import annotations

import torch


class ShardingError(ValueError):
    """A model that cannot be split over this many ranks."""


def check_heads(heads: int, world: int, family: str) -> int:
    """Heads per rank; raises when they do not split evenly."""
    if heads % world:
        raise ShardingError(f"{family}: {heads} attention heads do not split over {world} tensor-parallel ranks")
    return heads // world


def reorder_fused_qkv(linear: torch.nn.Linear, heads: int, world: int) -> None:
    """Rows [q | k | v] become [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], rank r's heads in slice r."""
    out_features, in_features = linear.weight.shape
    head_dim = out_features // 3 // heads
    with torch.no_grad():
        weight = linear.weight.view(3, world, heads // world, head_dim, in_features)
        linear.weight.copy_(weight.permute(1, 0, 2, 3, 4).reshape(out_features, in_features).clone())
        if linear.bias is not None:
            bias = linear.bias.view(3, world, heads // world, head_dim)
            linear.bias.copy_(bias.permute(1, 0, 2, 3).reshape(out_features).clone())
