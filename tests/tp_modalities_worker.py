"""One tensor-parallel rank for the image + video + audio families' plans: each modality's rows before and after
`FAMILY.shard`, over gloo on loopback.

Usage: python -m tests.tp_modalities_worker RANK WORLD INIT_URL OUT_JSON MODULE=FOLDER [MODULE=FOLDER ...]
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tests.omni_family_checkpoints import video, waveform
from tests.other_family_checkpoints import random_image


def items(modality: str, sampling_rate: int) -> list:
    if modality == "image":
        return [random_image(w, h, seed) for seed, (w, h) in enumerate([(60, 45), (130, 40), (30, 90)])]
    if modality == "video":
        return [video(60, 45, 3, 1), video(100, 50, 4, 2)]
    return [waveform(seconds, sampling_rate, seed) for seed, seconds in enumerate([0.5, 1.3])]


def main() -> None:
    rank, world, init_url, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo", init_method=init_url, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for spec in sys.argv[5:]:
        module, folder = spec.split("=", 1)
        family = importlib.import_module(module).FAMILY
        adapter = family.load(Path(folder), torch.device("cpu"), torch.float32)
        media = {modality: items(modality, getattr(adapter, "sampling_rate", 16000))
                 for modality in adapter.info.modalities}
        whole = {modality: adapter.forward(adapter.preprocess(modality, media[modality])) for modality in media}
        family.shard(adapter, mesh)
        sharded = sum(type(parameter).__name__ == "DTensor" for parameter in adapter.model.parameters())
        for modality, batch in media.items():
            split = adapter.forward(adapter.preprocess(modality, batch))
            reference = whole[modality]
            results[f"{family.name}/{modality}"] = {
                "rows": reference.shape[0], "rel": float((split - reference).abs().max() / reference.abs().max()),
                "sharded_parameters": sharded}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
