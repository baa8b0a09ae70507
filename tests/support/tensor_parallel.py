"""Tensor-parallel plans (`Family.shard`) on real gloo ranks over loopback, as processes.

- `run_ranks(specs, out, timeout)`: for checkpoint folders (`MODULE=FOLDER`): `world` ranks of this module
  (`python -m tests.support.tensor_parallel RANK WORLD INIT_URL OUT_JSON [--modalities] MODULE=FOLDER ...`), forked
  from the test zygote. Each loads every folder's adapter, encodes the same items before and after its family's plan
  is applied, and rank 0 writes per family the rows and their largest difference relative to the unsharded rows.
  Plain: images only, keyed by family name; with `--modalities`: every modality the model serves (images, videos,
  audio clips), keyed `family/modality`, with the count of sharded parameters.
- `sharded_rows(jobs)`: for built-in models: `world` ranks of this module too (`... OUT_PT --builtins JOBS_PICKLE`),
  forked from the test zygote (importing torch and the families is the slow part). For each job `(family module,
  built-in name, modality, items)` every rank builds the built-in model (bit-identical weights from its fixed
  seed), applies the family's plan over a CPU device mesh and runs one forward on the items; rank 0's rows come
  back, per job.
"""

from __future__ import annotations

import importlib
import json
import pickle
import socket
import sys
import tempfile
from pathlib import Path

import torch

IMAGE_SIZES = [(60, 45), (130, 40), (30, 90)]

Job = tuple[str, str, str, list]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- checkpoint folders: ranks as processes of this module ------------------------------------------

def run_ranks(specs: list[str], out: Path, timeout: float, modalities: bool = False, world: int = 2) -> dict:
    """Start `world` ranks of this module on `specs` (`MODULE=FOLDER`); assert they exit 0; rank 0's results."""
    _start_ranks(["--modalities", *specs] if modalities else specs, out, timeout, world)
    return json.loads(out.read_text())


def _start_ranks(args: list[str], out: Path, timeout: float, world: int) -> None:
    """`world` ranks of this module, forked from the test zygote, with these arguments after `OUT`; assert they exit
    0."""
    from tests.support.helpers import python_module

    init_url = f"tcp://127.0.0.1:{_free_port()}"
    ranks = [python_module("tests.support.tensor_parallel", str(rank), str(world), init_url, str(out), *args)
             for rank in range(world)]
    try:
        outputs = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]


def items(modality: str, sampling_rate: int) -> list:
    from tests.support.tiny_parts import clip, random_image, waveform

    if modality == "image":
        return [random_image(w, h, seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]
    if modality == "video":
        return [clip(3, 60, 45, 1), clip(4, 100, 50, 2)]
    return [waveform(seconds, sampling_rate, seed) for seed, seconds in enumerate([0.5, 1.3])]


def relative(split, whole) -> float:
    return float((split - whole).abs().max() / whole.abs().max())


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, init_url, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    specs = sys.argv[5:]
    if specs and specs[0] == "--builtins":
        _builtin_rank(rank, world, init_url, pickle.loads(Path(specs[1]).read_bytes()), out)
        return
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
        media = {modality: items(modality, adapter.processor.sampling_rate) for modality in served}
        whole = {modality: adapter.forward(adapter.processor.preprocess(modality,
                                                                        media[modality])) for modality in media}
        family.shard(adapter, mesh)
        if not all_modalities:
            split = adapter.forward(adapter.processor.preprocess("image", media["image"]))
            results[family.name] = {"rows": whole["image"].shape[0], "rel": relative(split, whole["image"])}
            continue
        sharded = sum(type(parameter).__name__ == "DTensor" for parameter in adapter.model.parameters())
        for modality, batch in media.items():
            split = adapter.forward(adapter.processor.preprocess(modality, batch))
            results[f"{family.name}/{modality}"] = {"rows": whole[modality].shape[0],
                                                    "rel": relative(split, whole[modality]),
                                                    "sharded_parameters": sharded}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


# --- built-in models -----------------------------------------------------------------------------------

def _builtin_rank(rank: int, world: int, init_url: str, jobs: list[Job], out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=init_url)
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,))
        results = []
        for module, builtin, modality, batch in jobs:
            family = importlib.import_module(module).FAMILY
            adapter = family.builtins[builtin](torch.device("cpu"), torch.float32)
            family.shard(adapter, mesh)
            results.append(adapter.forward(adapter.processor.preprocess(modality, batch)))
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def sharded_rows(jobs: list[Job], world: int = 2, timeout: float = 400) -> list[torch.Tensor]:
    with tempfile.TemporaryDirectory(prefix="sharded-rows-") as folder:
        jobs_path, out = Path(folder) / "jobs.pickle", Path(folder) / "rows.pt"
        jobs_path.write_bytes(pickle.dumps(jobs))
        _start_ranks(["--builtins", str(jobs_path)], out, timeout, world)
        return torch.load(out)


if __name__ == "__main__":
    main()
