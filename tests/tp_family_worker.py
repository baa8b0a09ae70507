"""One tensor-parallel rank of a family test: rows before and after `FAMILY.shard`, over gloo on loopback.

Usage: python -m tests.tp_family_worker RANK WORLD INIT_URL OUT_JSON [--modalities] MODULE=FOLDER [...]

Each folder's adapter encodes the same items before and after its plan is applied; rank 0 writes, per family, the
rows and their largest difference relative to the unsharded rows. Plain: images only, keyed by family name. With
`--modalities`: every modality the model serves (images, videos, audio clips), keyed `family/modality`, with the
count of sharded parameters.

`run_ranks` (used by the tests) starts the ranks and returns rank 0's results.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

IMAGE_SIZES = [(60, 45), (130, 40), (30, 90)]


def run_ranks(specs: list[str], out: Path, timeout: float, modalities: bool = False, world: int = 2) -> dict:
    """Start `world` ranks of this worker on `specs` (`MODULE=FOLDER`); assert they exit 0; rank 0's results."""
    from .helpers import free_port, python_module

    init_url = f"tcp://127.0.0.1:{free_port()}"
    mode = ["--modalities"] if modalities else []
    ranks = [python_module("tests.tp_family_worker", str(rank), str(world), init_url, str(out), *mode, *specs)
             for rank in range(world)]
    try:
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]
    return json.loads(out.read_text())


def items(modality: str, sampling_rate: int) -> list:
    from tests.omni_family_checkpoints import video, waveform
    from tests.tiny_parts import random_image

    if modality == "image":
        return [random_image(w, h, seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]
    if modality == "video":
        return [video(60, 45, 3, 1), video(100, 50, 4, 2)]
    return [waveform(seconds, sampling_rate, seed) for seed, seconds in enumerate([0.5, 1.3])]


def relative(split, whole) -> float:
    return float((split - whole).abs().max() / whole.abs().max())


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, init_url, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    specs = sys.argv[5:]
    all_modalities = bool(specs) and specs[0] == "--modalities"
    specs = specs[1:] if all_modalities else specs
    dist.init_process_group("gloo", init_method=init_url, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for spec in specs:
        module, folder = spec.split("=", 1)
        family = importlib.import_module(module).FAMILY
        adapter = family.load(Path(folder), torch.device("cpu"), torch.float32)
        served = adapter.info.modalities if all_modalities else ("image",)
        media = {modality: items(modality, getattr(adapter, "sampling_rate", 16000)) for modality in served}
        whole = {modality: adapter.forward(adapter.preprocess(modality, media[modality])) for modality in media}
        family.shard(adapter, mesh)
        if not all_modalities:
            split = adapter.forward(adapter.preprocess("image", media["image"]))
            results[family.name] = {"rows": whole["image"].shape[0], "rel": relative(split, whole["image"])}
            continue
        sharded = sum(type(parameter).__name__ == "DTensor" for parameter in adapter.model.parameters())
        for modality, batch in media.items():
            split = adapter.forward(adapter.preprocess(modality, batch))
            results[f"{family.name}/{modality}"] = {"rows": whole[modality].shape[0],
                                                    "rel": relative(split, whole[modality]),
                                                    "sharded_parameters": sharded}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
