"""The Qwen2.5-Omni and Qwen3-Omni tensor-parallel plans, on two real gloo ranks, against one unsplit process.

Vision heads and MLP columns are split (separate `q`, `k`, `v` in Qwen2.5-Omni, a fused `qkv` in
Qwen3-Omni), and so are the audio layers; the mergers (deepstack ones included) stay whole. The rows must
equal the unsplit model's (relative difference <= 1e-5) for fused images of different sizes, a video and
fused audio clips.
"""

from __future__ import annotations

import pytest
import torch

from encode_server.models.families import qwen2_5_omni, qwen3_omni_moe
from encode_server.models.sharding.blocks import ShardingError
from encode_server.models.towers.omni_thinker import shard_audio_tower

from .helpers import rel_diff
from .omni_checkpoints import sample_audio, sample_clips, sample_images
from .tp_ranks import sharded_rows

CPU, F32 = torch.device("cpu"), torch.float32
FAMILIES = {module.__name__: module.FAMILY for module in (qwen2_5_omni, qwen3_omni_moe)}


def test_two_ranks_give_the_rows_of_one():
    items = {"image": sample_images()[:3], "video": sample_clips()[:1], "audio": sample_audio("qwen3_omni_moe")[2:5]}
    jobs = [(module, builtin, modality, batch) for module, family in FAMILIES.items()
            for builtin in family.builtins for modality, batch in items.items()]
    got = sharded_rows(jobs)
    for (module, builtin, modality, batch), rows in zip(jobs, got, strict=True):
        adapter = FAMILIES[module].builtins[builtin](CPU, F32)
        want = adapter.forward(adapter.preprocess(modality, batch))
        assert rows.shape == want.shape == (want.shape[0], adapter.info.row_width_of(modality))
        assert rel_diff(rows, want) <= 1e-5, (builtin, modality)


class _Ranks:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("family", list(FAMILIES.values()), ids=lambda family: family.name)
def test_vision_heads_that_do_not_split_are_refused_before_anything_is_changed(family):
    adapter = next(iter(family.builtins.values()))(CPU, F32)
    before = {name: tensor.detach().clone() for name, tensor in adapter.encoder.state_dict().items()}
    with pytest.raises(ShardingError, match="4 attention heads do not split over 3"):
        family.shard(adapter, _Ranks(3))
    after = adapter.encoder.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_an_audio_tower_whose_heads_do_not_split_stays_whole():
    adapter = qwen3_omni_moe.FAMILY.builtins["tiny-qwen3-omni"](CPU, F32)
    weight = adapter.audio_tower.layers[0].self_attn.q_proj.weight.detach().clone()
    assert shard_audio_tower(adapter, _Ranks(3)) is False
    assert adapter.audio_tower.layers[0].self_attn.num_heads == 4
    assert torch.equal(adapter.audio_tower.layers[0].self_attn.q_proj.weight, weight)
