"""Every family's tensor-parallel plan (`Family.shard`): two gloo ranks on loopback give the rows of the unsharded
encoder (relative difference <= 1e-5) for fused items of different sizes in every modality tested, and a head
count that does not split is refused before any weight changes.

A family is tested either from a tiny checkpoint folder (ranks forked from the test zygote load it:
`run_ranks`) or from its built-in tiny model (ranks from a fork server: `sharded_rows`). Starting ranks is the
slow part, so each kind runs once for all its families (module fixtures) and each family is its own case. The
vision mergers (deepstack ones included) stay whole; what is split is checked by each family's own module.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from encode_server.models.registry import FAMILY_MODULES
from encode_server.models.sharding.blocks import ShardingError
from encode_server.models.towers.omni_thinker import shard_audio_tower
from tests.support.checkpoints import grid_vision
from tests.support.checkpoints.gemma3 import gemma3_checkpoint
from tests.support.checkpoints.glm5_next import glm5_next_checkpoint
from tests.support.checkpoints.kimi_k25 import kimi_k25_checkpoint
from tests.support.checkpoints.llava_onevision import llava_onevision_checkpoint
from tests.support.checkpoints.minimax_m3_vl import minimax_m3_vl_checkpoint
from tests.support.checkpoints.mistral3 import mistral3_checkpoint
from tests.support.checkpoints.muse_spark import muse_spark_checkpoint
from tests.support.checkpoints.qwen_omni import sample_audio
from tests.support.checkpoints.qwen_omni import sample_clips as omni_clips
from tests.support.checkpoints.qwen_omni import sample_images as omni_images
from tests.support.checkpoints.qwen_vl import qwen2_vl_checkpoint
from tests.support.helpers import rel_diff
from tests.support.tensor_parallel import run_ranks, sharded_rows

CPU, F32 = torch.device("cpu"), torch.float32
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _folder(build):
    """A builder's folder (they return `(model, folder)` or `(model, processor, folder)`)."""
    return lambda root: build(root / "tiny")[-1]


#: Families tested from a checkpoint folder: family (its module's name) -> (the folder builder, whether its
#: processors need torchvision). Images only, except muse_spark's (every modality it serves).
FOLDERS = {
    "qwen2_vl": (_folder(qwen2_vl_checkpoint), False),
    "gemma3": (_folder(gemma3_checkpoint), False),
    "llava_onevision": (_folder(llava_onevision_checkpoint), False),
    "mistral3": (_folder(mistral3_checkpoint), False),
    "kimi_k25": (_folder(kimi_k25_checkpoint), True),
    "glm5_next": (_folder(glm5_next_checkpoint), True),
    "minimax_m3_vl": (_folder(minimax_m3_vl_checkpoint), True),
}
MODALITY_FOLDERS = {"muse_spark": (lambda root: muse_spark_checkpoint(root)[1], True)}
#: Families tested from their built-in tiny model: family -> {modality: items}.
GRID_MEDIA = {"image": grid_vision.sample_images()[:3], "video": grid_vision.sample_clips()[1:3]}
OMNI_MEDIA = {"image": omni_images()[:3], "video": omni_clips()[:1], "audio": sample_audio("qwen3_omni_moe")[2:5]}
BUILTINS = {
    "qwen2_5_vl": GRID_MEDIA,
    "internvl": {"image": GRID_MEDIA["image"]},
    "qwen2_audio": {"audio": sample_audio("qwen2_5_omni")[:3]},
    "qwen3_vl": GRID_MEDIA,
    "glm4v": GRID_MEDIA,
    "qwen2_5_omni": OMNI_MEDIA,
    "qwen3_omni_moe": OMNI_MEDIA,
}
ALL = [*FOLDERS, *MODALITY_FOLDERS, *BUILTINS]


def plan_of(family: str):
    """The family's `Family` (its module is named after it)."""
    return importlib.import_module(f"encode_server.models.families.{family}").FAMILY


def needs_torchvision(family: str) -> bool:
    return {**FOLDERS, **MODALITY_FOLDERS}.get(family, (None, False))[1]


CASES = [pytest.param(family, marks=pytest.mark.skipif(
    needs_torchvision(family) and not HAS_TORCHVISION, reason="this family's transformers processors need torchvision"))
    for family in ALL]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """family -> its checkpoint folder, for the folder families this environment can load."""
    return {family: build(tmp_path_factory.mktemp(family))
            for family, (build, torchvision) in {**FOLDERS, **MODALITY_FOLDERS}.items()
            if HAS_TORCHVISION or not torchvision}


@pytest.fixture(scope="module")
def two_ranks(folders, tmp_path_factory) -> dict:
    """family -> what two ranks gave: `{"rank0": {modality: (rows, rel)}, ...}`, all families run at once."""
    out = tmp_path_factory.mktemp("tensor-parallel")
    results: dict[str, dict] = {}
    package = "encode_server.models.families"
    plain = [f"{package}.{family}={folder}" for family, folder in folders.items() if family in FOLDERS]
    for name, result in run_ranks(plain, out / "plain.json", timeout=400).items():
        results.setdefault(name, {})["image"] = (result["rows"], result["rel"], None)
    every = [f"{package}.{family}={folder}" for family, folder in folders.items() if family in MODALITY_FOLDERS]
    if every:
        for key, result in run_ranks(every, out / "modalities.json", timeout=300, modalities=True).items():
            family, modality = key.split("/")
            results.setdefault(family, {})[modality] = (result["rows"], result["rel"], result["sharded_parameters"])
    jobs = [(f"{package}.{family}", builtin, modality, batch) for family, media in BUILTINS.items()
            for builtin in plan_of(family).builtins for modality, batch in media.items()]
    for (module, builtin, modality, batch), rows in zip(jobs, sharded_rows(jobs), strict=True):
        family = module.rpartition(".")[2]
        adapter = plan_of(family).builtins[builtin](CPU, F32)
        want = adapter.forward(adapter.processor.preprocess(modality, batch))
        assert rows.shape == want.shape == (want.shape[0], adapter.info.row_width_of(modality)), (builtin, modality)
        results.setdefault(family, {})[f"{builtin}/{modality}"] = (want.shape[0], rel_diff(rows, want), None)
    return results


def test_every_family_with_a_plan_is_tested_here():
    families = [importlib.import_module(module).FAMILY for module in FAMILY_MODULES]
    assert {family.name for family in families if family.shard is not None} == set(ALL)


@pytest.mark.parametrize("family", CASES)
def test_two_ranks_give_the_unsharded_rows(family, two_ranks):
    results = two_ranks[family]
    if family in BUILTINS:
        builtins = plan_of(family).builtins
        assert set(results) == {f"{builtin}/{modality}" for builtin in builtins for modality in BUILTINS[family]}
    elif family in MODALITY_FOLDERS:
        assert set(results) == {"image", "video", "audio"}
    else:
        assert set(results) == {"image"}
    for name, (rows, rel, sharded) in results.items():
        assert rows > 0 and rel <= 1e-5, (family, name, rel)
        if family == "muse_spark":
            assert sharded == 2 * 12, sharded  # 2 blocks x 6 linears (q, k, v, proj, fc1, fc2) x 2


class Ranks:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def load(family: str, folders: dict):
    plan = plan_of(family)
    if family in BUILTINS:
        return plan, next(iter(plan.builtins.values()))(CPU, F32)
    return plan, plan.load(folders[family], CPU, F32)


@pytest.mark.parametrize("family", CASES)
def test_heads_that_do_not_split_are_refused_before_anything_changes(family, folders):
    plan, adapter = load(family, folders)
    weights = adapter.encoder if hasattr(adapter, "encoder") else adapter.model
    before = {key: tensor.detach().clone() for key, tensor in weights.state_dict().items()}
    with pytest.raises(ShardingError, match="4 attention heads do not split over 3"):
        plan.shard(adapter, Ranks(3))
    after = weights.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[key], tensor) for key, tensor in before.items())


def test_an_audio_tower_whose_heads_do_not_split_stays_whole():
    adapter = plan_of("qwen3_omni_moe").builtins["tiny-qwen3-omni"](CPU, F32)
    weight = adapter.audio_tower.layers[0].self_attn.q_proj.weight.detach().clone()
    assert shard_audio_tower(adapter, Ranks(3)) is False
    assert adapter.audio_tower.layers[0].self_attn.num_heads == 4
    assert torch.equal(adapter.audio_tower.layers[0].self_attn.q_proj.weight, weight)
