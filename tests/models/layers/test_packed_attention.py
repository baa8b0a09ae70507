"""Packed attention (every segment of a batch in a few SDPA calls) and zero-padded MLP widths compute what
`transformers`' own vision towers compute."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from encode_server.models import load_adapter
from encode_server.models.layers import packed_attention
from encode_server.models.layers.aligned_mlp import align_mlp_widths
from encode_server.models.layers.packed_attention import PACKED_ATTENTION, _grouped_sdpa

pytestmark = pytest.mark.quick

GRID_TOWERS = ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"]


def images(*sizes: tuple[int, int]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def per_segment(q, k, v, bounds, scale):
    """The reference: one SDPA call per segment, as `transformers` loops."""
    out = torch.zeros_like(q)
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            out[start:end] = F.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1) for t in (q, k, v)), scale=scale).transpose(0, 1)
    return out


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=12), heads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_grouped_sdpa_attends_within_each_segment(lengths, heads, seed):
    """Segments of any lengths (repeated, unique, empty) in any order give the per-segment loop's values."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(bounds[-1], heads, 8, generator=generator) for _ in range(3))
    got = _grouped_sdpa(q, k, v, torch.tensor(bounds, dtype=torch.int32), 0.3)
    torch.testing.assert_close(got, per_segment(q, k, v, bounds, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", GRID_TOWERS)
def test_the_grid_towers_attend_packed_with_transformers_values(name, monkeypatch):
    """The adapters configure packed attention, the tower really goes through it, and the rows are those of
    `transformers`' own per-segment loop (images of several sizes, so windows and images of many lengths)."""
    adapter = load_adapter(name, "cpu", "float32")
    assert adapter.packed_attention and adapter.tower.config._attn_implementation == PACKED_ATTENTION
    batch = adapter.processor.preprocess("image", images((448, 448), (300, 200), (90, 60), (448, 448), (250, 330)))
    calls = []
    grouped = packed_attention._grouped_sdpa
    monkeypatch.setattr(packed_attention, "_grouped_sdpa", lambda *a: calls.append(1) or grouped(*a))
    packed = adapter.forward(batch)
    assert len(calls) == len(adapter.tower.blocks)
    adapter.tower.config._attn_implementation = "sdpa"
    loop = adapter.forward(batch)
    torch.testing.assert_close(packed, loop, rtol=1e-5, atol=1e-6)


def test_anything_but_segment_self_attention_is_refused():
    q = torch.randn(1, 2, 6, 8)
    bounds = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="bidirectional"):
        packed_attention.packed_attention(None, q, q, q, is_causal=True, cu_seq_lens_q=bounds)
    with pytest.raises(ValueError, match="bidirectional"):
        packed_attention.packed_attention(None, q, q, q, cu_seq_lens_q=bounds,
                                          cu_seq_lens_k=torch.tensor([0, 3, 6], dtype=torch.int32))


def odd_width_qwen25_tower():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=64, intermediate_size=100, num_heads=4, out_hidden_size=64,
                                    fullatt_block_indexes=[1])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()


def odd_width_qwen2_tower():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(depth=2, embed_dim=36, hidden_size=64, mlp_ratio=3, num_heads=3)  # width 108
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2VisionTransformerPretrainedModel._from_config(config).eval()


@pytest.mark.parametrize("build, mlp_names", [(odd_width_qwen25_tower, ("gate_proj", "up_proj", "down_proj")),
                                               (odd_width_qwen2_tower, ("fc1", "fc2"))])
def test_padded_mlp_widths_compute_the_same_rows(build, mlp_names):
    """Widths of 100 and 108 padded to 128 with zeros (gated and plain MLPs): every block padded, same rows."""
    tower = build()
    padded = copy.deepcopy(tower)
    assert align_mlp_widths(padded) == len(tower.blocks)
    *into, out_of = (getattr(padded.blocks[0].mlp, name) for name in mlp_names)
    assert all(linear.weight.shape[0] == 128 for linear in into) and out_of.weight.shape[1] == 128
    assert out_of.in_features == 128 and all(linear.out_features == 128 for linear in into)
    rows = torch.randn(16 * 16, padded.patch_embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(3))
    grid = torch.tensor([[1, 16, 16]])
    with torch.inference_mode():
        want = tower(rows, grid_thw=grid).pooler_output
        got = padded(rows, grid_thw=grid).pooler_output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert align_mlp_widths(padded) == 0  # already aligned: nothing more to do


def test_aligned_widths_and_cpu_adapters_are_left_alone():
    adapter = load_adapter("tiny-qwen2.5-vl", "cpu", "float32")
    assert adapter.padded_mlps == 0  # only on CUDA
    assert align_mlp_widths(adapter.tower) == 0  # width 256: already a multiple of 64
    # A multiple of 8 (Qwen3-VL's 4,304 is one) already suits the fast kernels: left alone.
    tower = odd_width_qwen25_tower()
    for block in tower.blocks:
        for name in ("gate_proj", "up_proj"):
            linear = getattr(block.mlp, name)
            linear.weight = torch.nn.Parameter(linear.weight.detach()[:96])
            linear.bias = torch.nn.Parameter(linear.bias.detach()[:96])
            linear.out_features = 96
        block.mlp.down_proj.weight = torch.nn.Parameter(block.mlp.down_proj.weight.detach()[:, :96])
        block.mlp.down_proj.in_features = 96
    assert align_mlp_widths(tower) == 0
