"""Tensor-parallel plans of Gemma 3, LLaVA-OneVision and Mistral 3: two gloo ranks on loopback give the rows of
the unsharded encoder; a head count that does not split is refused before anything is sharded."""

from __future__ import annotations

import importlib

import pytest
import torch

from encode_server.models.sharding.blocks import ShardingError

from .other_family_checkpoints import gemma3_checkpoint, llava_onevision_checkpoint, mistral3_checkpoint
from .tp_family_worker import run_ranks

BUILDERS = {"encode_server.models.families.gemma3": gemma3_checkpoint,
            "encode_server.models.families.llava_onevision": llava_onevision_checkpoint,
            "encode_server.models.families.mistral3": mistral3_checkpoint}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {module: build(tmp_path_factory.mktemp(module.split(".")[1]))[1] for module, build in BUILDERS.items()}


def test_two_ranks_give_the_unsharded_rows(folders, tmp_path):
    specs = [f"{module}={folder}" for module, folder in folders.items()]
    results = run_ranks(specs, tmp_path / "tp.json", timeout=240)
    assert set(results) == {"gemma3", "llava_onevision", "mistral3"}
    for name, result in results.items():
        assert result["rows"] > 0 and result["rel"] <= 1e-5, (name, result)


class ThreeRanks:
    def size(self) -> int:
        return 3


@pytest.mark.parametrize("module", list(BUILDERS))
def test_heads_that_do_not_split_are_refused(module, folders):
    family = importlib.import_module(module).FAMILY
    adapter = family.load(folders[module], torch.device("cpu"), torch.float32)
    with pytest.raises(ShardingError, match="4 attention heads do not split over 3"):
        family.shard(adapter, ThreeRanks())
