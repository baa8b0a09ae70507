"""`layers.grid_indices`: the index tensors a Qwen2-VL / Qwen2.5-VL tower computes per item, computed once per
grid and joined per batch, are exactly transformers' own, and the rows with them are bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from encode_server.models import load_adapter
from encode_server.models.layers.grid_indices import GridIndices, grid_arguments

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def qwen25_tower():
    return load_adapter("tiny-qwen2.5-vl", "cpu", "float32").tower


@pytest.fixture(scope="module")
def qwen2_tower():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                                 spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VisionTransformerPretrainedModel._from_config(config)


def transformers_own(tower, grid: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the tower's forward computes for `grid` when given nothing."""
    own = {"position_ids": get_vision_position_ids(grid, tower.spatial_merge_size)}
    if hasattr(tower, "window_size"):
        own["window_index"], own["cu_window_seqlens"] = get_vision_window_index(
            grid, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
            patch_size=tower.patch_size)
    return own


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].device == tensor.device, name
        assert torch.equal(got[name], tensor), name


#: (t, h, w) grids as the Qwen processors make them: h and w in patches, multiples of the merge size (2).
grids = st.lists(st.tuples(st.integers(1, 3), st.integers(1, 24).map(lambda n: 2 * n),
                           st.integers(1, 24).map(lambda n: 2 * n)), min_size=1, max_size=10)


@settings(max_examples=60, deadline=None)
@given(shapes=grids)
def test_joined_indices_equal_transformers_own_for_any_batch_of_grids(qwen25_tower, qwen2_tower, shapes):
    """Repeated and distinct grids, images (t = 1) and videos, windows cut short at the edges, in any order."""
    grid = torch.tensor(shapes)
    assert_same(grid_arguments(qwen25_tower, grid), transformers_own(qwen25_tower, grid))
    assert_same(grid_arguments(qwen2_tower, grid), transformers_own(qwen2_tower, grid))


def test_each_grid_is_computed_once_and_the_rows_are_bit_identical(qwen25_tower):
    indices = GridIndices(qwen25_tower)
    grid = torch.tensor([[1, 4, 4]] * 30 + [[1, 8, 6], [2, 4, 4]])
    indices.arguments(grid)
    assert indices._one.cache_info().misses == 3 and indices._one.cache_info().hits == 29
    rng = np.random.default_rng(0)
    adapter = load_adapter("tiny-qwen2.5-vl", "cpu", "float32")
    sizes = [(56, 56), (300, 200), (90, 60), (56, 56), (250, 330)]
    batch = adapter.processor.preprocess("image", [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                                         for w, h in sizes])
    pixels, grid = batch.inputs["pixel_values"], batch.inputs["grid_thw"]
    with torch.inference_mode():
        given = adapter.tower(pixels, grid_thw=grid, **grid_arguments(adapter.tower, grid)).pooler_output
        computed = adapter.tower(pixels, grid_thw=grid).pooler_output
    assert torch.equal(given, computed)


def test_a_tower_that_takes_no_such_arguments_is_given_none():
    assert grid_arguments(torch.nn.Linear(2, 2), torch.tensor([[1, 4, 4]])) == {}
