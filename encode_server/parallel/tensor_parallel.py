"""Tensor-parallel plans per encoder family, and the batch-layout digest ranks agree on.

Each transformer block's attention projections and MLP are sharded with
`torch.distributed.tensor.parallel`: the input projections column-wise (each rank computes its own
heads or its own slice of the hidden layer) and the output projections row-wise (an all-reduce sums
the partial results), so every rank ends a block with the full hidden state and no hand-written
collective is needed. Attention modules are told their local head count. A fused `qkv` weight is
first reordered so that each rank's column slice holds its own heads' q, k and v.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from processors import EncoderAdapter, PreparedBatch


class ShardingError(ValueError):
    """A model that cannot be split over this many ranks."""


def _check_heads(heads: int, world: int, family: str) -> int:
    if heads % world:
        raise ShardingError(f"{family}: {heads} attention heads do not split over {world} tensor-parallel ranks")
    return heads // world


def _reorder_fused_qkv(linear: torch.nn.Linear, heads: int, world: int) -> None:
    """Rows [q | k | v] become [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], rank r's heads in slice r."""
    out_features, in_features = linear.weight.shape
    head_dim = out_features // 3 // heads
    with torch.no_grad():
        weight = linear.weight.view(3, world, heads // world, head_dim, in_features)
        linear.weight.copy_(weight.permute(1, 0, 2, 3, 4).reshape(out_features, in_features).clone())
        if linear.bias is not None:
            bias = linear.bias.view(3, world, heads // world, head_dim)
            linear.bias.copy_(bias.permute(1, 0, 2, 3).reshape(out_features).clone())


def shard_encoder(adapter: EncoderAdapter, mesh: DeviceMesh) -> None:
    """Split the adapter's encoder over `mesh` in place (identical weights on every rank first)."""
    world = mesh.size()
    family = adapter.info.family
    colwise, rowwise = ColwiseParallel(), RowwiseParallel()
    if family == "qwen2_5_vl":
        for block in adapter.encoder["visual"].blocks:
            local = _check_heads(block.attn.num_heads, world, family)
            _reorder_fused_qkv(block.attn.qkv, block.attn.num_heads, world)
            block.attn.num_heads = local
            parallelize_module(block.attn, mesh, {"qkv": colwise, "proj": rowwise})
            parallelize_module(block.mlp, mesh, {"gate_proj": colwise, "up_proj": colwise, "down_proj": rowwise})
    elif family == "internvl":
        for layer in adapter.encoder["vision_tower"].encoder.layer:
            attention = layer.attention
            if not isinstance(attention.q_norm, torch.nn.Identity):
                raise ShardingError("internvl: towers with qk-norm normalise across all heads; "
                                    "tensor parallelism is not supported for them")
            local = _check_heads(attention.num_heads, world, family)
            attention.num_heads, attention.embed_dim = local, attention.embed_dim // world
            parallelize_module(attention, mesh, {"q_proj": colwise, "k_proj": colwise, "v_proj": colwise,
                                                 "projection_layer": rowwise})
            parallelize_module(layer.mlp, mesh, {"fc1": colwise, "fc2": rowwise})
    elif family == "qwen2_audio":
        for layer in adapter.encoder["audio_tower"].layers:
            attention = layer.self_attn
            local = _check_heads(attention.num_heads, world, family)
            attention.num_heads = local
            parallelize_module(attention, mesh, {"q_proj": colwise, "k_proj": colwise, "v_proj": colwise,
                                                 "out_proj": rowwise})
            parallelize_module(layer, mesh, {"fc1": colwise, "fc2": rowwise})
    else:
        raise ShardingError(f"no tensor-parallel plan for the {family} family")


def start_tensor_parallel(adapter: EncoderAdapter, device: str, init_method: str, rank: int, world_size: int) -> None:
    """Join the process group (NCCL on GPUs, gloo on CPU; waits for every rank) and shard the encoder."""
    import datetime

    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world_size,))
    shard_encoder(adapter, mesh)


def layout_digest(batch: PreparedBatch | None) -> int:
    """A 63-bit digest of what a rank is about to run: modality, item layouts, input shapes.

    `None` (this rank could not prepare the batch) digests to -1, which never matches.
    """
    if batch is None:
        return -1
    description = {
        "modality": batch.modality,
        "layouts": [[layout.tokens, *layout.grid_thw] for layout in batch.layouts],
        "shapes": {name: list(value.shape) for name, value in sorted(batch.inputs.items())
                   if isinstance(value, torch.Tensor)},
    }
    raw = hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def agree_on_layout(batch: PreparedBatch | None, group=None) -> None:
    """All-gather every rank's digest; raise on every rank together if any differs or is -1."""
    mine = torch.tensor([layout_digest(batch)], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    values = [int(t.item()) for t in gathered]
    if -1 in values:
        raise RuntimeError(f"rank {values.index(-1)} could not prepare the batch; skipped on every rank")
    if len(set(values)) != 1:
        raise RuntimeError(f"tensor-parallel ranks disagree on the batch layout (digests {values})")
