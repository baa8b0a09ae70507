"""Applying a family's tensor-parallel plan, and the batch-layout digest ranks agree on.

Each family declares its own plan (`Family.shard`, built from `encode_server/models/sharding/blocks.py`); a family
without one cannot run with `--tp-size > 1`, and `shard_encoder` says so at start-up.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from encode_server.models import EncoderAdapter, PreparedBatch
from encode_server.models.registry import family_named
from encode_server.models.sharding.blocks import ShardingError

__all__ = ["ShardingError", "agree_on_layout", "layout_digest", "shard_encoder"]


def shard_encoder(adapter: EncoderAdapter, mesh: DeviceMesh) -> None:
    """Split the adapter's encoder over `mesh` in place (identical weights on every rank first)."""
    name = adapter.info.family
    family = family_named(name)
    if family is None or family.shard is None:
        raise ShardingError(f"{name}: this family has no tensor-parallel plan, so --tp-size must be 1 "
                            f"(use --dp-size to spread load over several devices)")
    family.shard(adapter, mesh)


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
