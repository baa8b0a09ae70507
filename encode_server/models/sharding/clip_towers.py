"""Tensor-parallel plan for CLIP-style vision towers (SigLIP, CLIP, MiniMax-M3's), shared by Gemma 3,
LLaVA-OneVision and MiniMax-M3 VL.

Each encoder layer's attention has separate `q_proj`/`k_proj`/`v_proj` (split column-wise: every rank
holds whole heads) and `out_proj` (row-wise: the all-reduce sums the heads' contributions); the MLP's
`fc1` is split column-wise and `fc2` row-wise. The attention reshapes with `-1` heads, so only the
local head count and width need updating. Everything else (embeddings, norms, projector) stays
replicated.
"""

from __future__ import annotations

from typing import Any

import torch

from encode_server.models.sharding.blocks import ShardingError, check_heads, split_linears


def clip_like_layers(tower: torch.nn.Module, family: str) -> torch.nn.ModuleList:
    """The encoder layers of a CLIP/SigLIP vision model (with or without the `vision_model` wrapper), or of a
    tower that holds CLIP-style layers itself (MiniMax-M3's `layers`)."""
    inner = getattr(tower, "vision_model", tower)
    layers = getattr(getattr(inner, "encoder", None), "layers", None)
    if layers is None:
        layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        raise ShardingError(f"{family}: the vision tower {type(tower).__name__} is not a CLIP-style encoder; "
                            "no tensor-parallel plan for it")
    return layers


def shard_clip_like_encoder(tower: torch.nn.Module, mesh: Any, family: str) -> None:
    """Split every encoder layer of `tower` over `mesh` in place."""
    world = mesh.size()
    for layer in clip_like_layers(tower, family):
        attention = layer.self_attn
        local = check_heads(attention.num_heads, world, family)
        attention.num_heads, attention.embed_dim = local, attention.embed_dim // world
        split_linears(attention, mesh, colwise=("q_proj", "k_proj", "v_proj"), rowwise=("out_proj",))
        split_linears(layer.mlp, mesh, colwise=("fc1",), rowwise=("fc2",))
