"""Building blocks of the families' tensor-parallel plans (`Family.shard`).

A plan shards each transformer block with `torch.distributed.tensor.parallel`: the input
projections column-wise (each rank computes its own heads or its own slice of the hidden layer) and
the output projections row-wise (an all-reduce sums the partial results), so every rank ends a block
with the full hidden state and no hand-written collective is needed. Attention modules are told
their local head count. A fused `qkv` weight is first reordered so that each rank's column slice
holds its own heads' q, k and v. `torch.distributed` is imported only when a plan is applied.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class ShardingError(ValueError):
    """A model that cannot be split over this many ranks (or has no tensor-parallel plan)."""


def check_heads(heads: int, world: int, family: str) -> int:
    """The heads each rank holds; refuses a head count that does not split evenly."""
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


def split_linears(module: torch.nn.Module, mesh: Any, colwise: Iterable[str], rowwise: Iterable[str]) -> None:
    """Shard `module`'s named linears: `colwise` ones by output features, `rowwise` ones by input features."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in colwise} | {name: RowwiseParallel() for name in rowwise}
    parallelize_module(module, mesh, plan)
