"""Tensor-parallel plans of Kimi K2.5, GLM-5-Next and MiniMax-M3 VL: two gloo ranks on loopback give the rows of
the unsharded encoder (from real checkpoint folders); a head count that does not split is refused before any
weight changes."""

from __future__ import annotations

import importlib

import pytest
import torch

from encode_server.models.sharding.blocks import ShardingError

from .kimi_glm5_minimax_checkpoints import CHECKPOINTS
from .tp_family_worker import run_ranks

pytest.importorskip("torchvision", reason="these families' transformers processors need torchvision")

MODULES = {f"encode_server.models.families.{model_type}": build for model_type, build in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {module: build(tmp_path_factory.mktemp(module.split(".")[1]) / "tiny")[1]
            for module, build in MODULES.items()}


def test_two_ranks_give_the_unsharded_rows(folders, tmp_path):
    specs = [f"{module}={folder}" for module, folder in folders.items()]
    results = run_ranks(specs, tmp_path / "tp.json", timeout=300)
    assert set(results) == {"kimi_k25", "glm5_next", "minimax_m3_vl"}
    for name, result in results.items():
        assert result["rows"] > 0 and result["rel"] <= 1e-5, (name, result)


class ThreeRanks:
    def size(self) -> int:
        return 3


@pytest.mark.parametrize("module", list(MODULES))
def test_heads_that_do_not_split_are_refused_before_anything_changes(module, folders):
    family = importlib.import_module(module).FAMILY
    adapter = family.load(folders[module], torch.device("cpu"), torch.float32)
    modules = adapter.encoder if hasattr(adapter, "encoder") else adapter.model
    before = {key: tensor.clone() for key, tensor in modules.state_dict().items()}
    with pytest.raises(ShardingError, match="4 attention heads do not split over 3"):
        family.shard(adapter, ThreeRanks())
    assert all(torch.equal(tensor, before[key]) for key, tensor in modules.state_dict().items())
