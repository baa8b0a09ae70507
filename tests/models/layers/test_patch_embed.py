"""Qwen-grid patch embeddings by matrix multiply give the Conv3d's values, and only such convolutions change."""

from __future__ import annotations

import pytest
import torch

from encode_server.models import load_adapter
from encode_server.models.layers.patch_embed import _as_matmul, patches_as_matmul

pytestmark = pytest.mark.quick


def conv3d_embedding(patch_embed: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """What the `transformers` module computes: each row viewed as a `C x T x P x P` block, then the Conv3d."""
    proj = patch_embed.proj
    blocks = rows.view(-1, proj.in_channels, *proj.kernel_size).to(proj.weight.dtype)
    return proj(blocks).view(-1, patch_embed.embed_dim)


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"])
def test_the_grid_towers_embed_by_matmul_with_the_same_values(name):
    adapter = load_adapter(name, "cpu", "float32")
    patch_embed = adapter.tower.patch_embed
    assert patch_embed.forward.__func__ is _as_matmul
    proj = patch_embed.proj
    if proj.bias is not None:  # built-in biases start at zero: make forgetting (or doubling) the bias show
        with torch.no_grad():
            proj.bias.normal_(generator=torch.Generator().manual_seed(2))
    rows = torch.randn(37, proj.weight[0].numel(), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(patch_embed(rows), conv3d_embedding(patch_embed, rows), rtol=1e-5, atol=1e-5)


def test_bfloat16_stays_within_its_rounding():
    adapter = load_adapter("tiny-qwen2.5-vl", "cpu", "bfloat16")
    patch_embed = adapter.tower.patch_embed
    rows = torch.randn(64, patch_embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(1))
    got, want = patch_embed(rows), conv3d_embedding(patch_embed, rows)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


class Embed(torch.nn.Module):
    def __init__(self, **conv) -> None:
        super().__init__()
        self.embed_dim = 8
        self.proj = torch.nn.Conv3d(3, 8, **conv)


@pytest.mark.parametrize("conv", [
    dict(kernel_size=(2, 4, 4), stride=(1, 4, 4)),  # overlapping windows
    dict(kernel_size=(2, 4, 4), stride=(2, 4, 4), padding=(0, 1, 1)),
    dict(kernel_size=(2, 4, 4), stride=(2, 4, 4), dilation=(1, 2, 2)),
])
def test_other_convolutions_are_left_alone(conv):
    embed = Embed(**conv)
    assert not patches_as_matmul(embed)
    assert "forward" not in vars(embed)


def test_a_module_without_a_conv3d_is_left_alone():
    module = torch.nn.Module()
    module.proj, module.embed_dim = torch.nn.Linear(4, 4), 4
    assert not patches_as_matmul(module) and "forward" not in vars(module)


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"])
def test_forward_items_embeds_each_items_pixels_apart_with_the_collated_rows(name):
    """The pool's path: per-item results go to the tower as a list (never concatenated), same rows."""
    import numpy as np
    from PIL import Image

    adapter = load_adapter(name, "cpu", "float32")
    images = [Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
              for seed, (w, h) in enumerate([(120, 90), (300, 200), (56, 56)])]
    seen: list[type] = []
    adapter.tower.patch_embed.register_forward_pre_hook(lambda module, args: seen.append(type(args[0])))
    for modality, items in (("image", images), ("video", [images[:1] * 3, images[1:2] * 2])):
        per_item = [adapter.processor.preprocess(modality, [item]) for item in items]
        seen.clear()
        layouts, rows = adapter.forward_items(per_item)
        assert seen == [list]
        assert not rows.requires_grad  # no autograd graph, as in `forward`
        collated = adapter.processor.collate(per_item)
        assert layouts == collated.layouts
        torch.testing.assert_close(rows, adapter.forward(collated), rtol=1e-6, atol=1e-6)
