"""Run built-in models' tensor-parallel plans (`Family.shard`) on real gloo ranks, as processes.

`sharded_rows(jobs)` starts `world` processes on loopback once for all jobs, from multiprocessing's fork
server (which imports torch and the families once per test worker: importing them is the slow part); for
each job `(family module, built-in name, modality, items)` every rank
builds the built-in model (bit-identical weights from its fixed seed), applies the family's plan
over a CPU device mesh, and runs one forward on the same items. Rank 0's rows come back, per job.
"""

from __future__ import annotations

import importlib
import multiprocessing
import socket

import torch
import torch.multiprocessing as mp

from encode_server.models.registry import FAMILY_MODULES

Job = tuple[str, str, str, list]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, jobs: list[Job], results: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,))
        for index, (module, builtin, modality, items) in enumerate(jobs):
            family = importlib.import_module(module).FAMILY
            adapter = family.builtins[builtin](torch.device("cpu"), torch.float32)
            family.shard(adapter, mesh)
            rows = adapter.forward(adapter.preprocess(modality, items))
            if rank == 0:
                results[index] = rows.clone()
    finally:
        dist.destroy_process_group()


def sharded_rows(jobs: list[Job], world: int = 2) -> list[torch.Tensor]:
    with mp.Manager() as manager:
        results = manager.dict()
        multiprocessing.set_forkserver_preload(["tests.tp_ranks", "torch.distributed", *FAMILY_MODULES])
        mp.start_processes(_rank, args=(world, _free_port(), jobs, results), nprocs=world, join=True,
                           start_method="forkserver")
        return [results[index] for index in range(len(jobs))]
