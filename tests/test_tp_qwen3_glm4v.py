"""The Qwen3-VL and GLM-4V tensor-parallel plans, on two real gloo ranks, against one unsplit process.

Attention heads and MLP columns are split (the `shard` plans of `encode_server/models/families/qwen3_vl.py` and
`glm4v.py`); the mergers, deepstack ones included, stay whole. The rows must equal the unsplit
model's (relative difference <= 1e-5) for fused images of different sizes and for a video.
"""

from __future__ import annotations

import pytest
import torch

from encode_server.models.families import glm4v, qwen3_vl
from encode_server.models.sharding.blocks import ShardingError

from .helpers import rel_diff
from .tp_ranks import sharded_rows
from .vlm_fixtures import sample_clips, sample_images

CPU, F32 = torch.device("cpu"), torch.float32


def test_two_ranks_give_the_rows_of_one():
    images, clips = sample_images()[:3], sample_clips()[1:3]
    jobs = [(qwen3_vl.__name__, "tiny-qwen3-vl", "image", images),
            (qwen3_vl.__name__, "tiny-qwen3-vl", "video", clips),
            (glm4v.__name__, "tiny-glm4v", "image", images),
            (glm4v.__name__, "tiny-glm4v", "video", clips)]
    got = sharded_rows(jobs)
    for (module, builtin, modality, items), rows in zip(jobs, got, strict=True):
        family = {qwen3_vl.__name__: qwen3_vl.FAMILY, glm4v.__name__: glm4v.FAMILY}[module]
        adapter = family.builtins[builtin](CPU, F32)
        want = adapter.forward(adapter.preprocess(modality, items))
        assert rows.shape == want.shape == (want.shape[0], adapter.info.row_width)
        assert rel_diff(rows, want) <= 1e-5, (builtin, modality)


class _ThreeRanks:
    def size(self) -> int:
        return 3


@pytest.mark.parametrize("family", [qwen3_vl.FAMILY, glm4v.FAMILY])
def test_heads_that_do_not_split_are_refused_before_anything_is_changed(family):
    adapter = next(iter(family.builtins.values()))(CPU, F32)
    qkv = adapter.encoder["visual"].blocks[0].attn.qkv.weight.detach().clone()
    with pytest.raises(ShardingError, match="4 attention heads do not split over 3"):
        family.shard(adapter, _ThreeRanks())
    assert torch.equal(adapter.encoder["visual"].blocks[0].attn.qkv.weight, qkv)
