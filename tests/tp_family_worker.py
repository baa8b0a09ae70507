"""One tensor-parallel rank for `test_family_tp.py`: rows before and after `FAMILY.shard`, over gloo on loopback.

Usage: python -m tests.tp_family_worker RANK WORLD INIT_URL OUT_JSON MODULE=FOLDER [MODULE=FOLDER ...]
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.other_family_checkpoints import random_image

SIZES = [(60, 45), (130, 40), (30, 90)]


def main() -> None:
    rank, world, init_url, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=init_url, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for spec in sys.argv[5:]:
        module, folder = spec.split("=", 1)
        family = importlib.import_module(module).FAMILY
        adapter = family.load(Path(folder), torch.device("cpu"), torch.float32)
        items = [random_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
        whole = adapter.forward(adapter.preprocess("image", items))
        family.shard(adapter, mesh)
        split = adapter.forward(adapter.preprocess("image", items))
        results[family.name] = {"rows": whole.shape[0], "rel": float((split - whole).abs().max() / whole.abs().max())}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
