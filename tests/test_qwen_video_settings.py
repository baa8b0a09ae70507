"""Qwen processor settings come from where `transformers` takes them, and videos get its row counts.

The video processor's settings are resolved as `get_video_processor_dict` does (nested
`video_processor` of processor_config.json, then video_preprocessor_config.json, then
preprocessor_config.json), with `Qwen2VLVideoProcessor`'s per-frame token cap. That processor needs
torchvision, absent here, so its grids were computed once by `scripts/reference_video_grids.py`
(run with torch 2.14.1 + torchvision 0.29.1 + transformers 5.23.0) and are committed below as literals.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from processors.registry import load_checkpoint
from scripts.reference_video_grids import CASES, PREPROCESSOR, write_case

from .checkpoints import qwen25_vl_checkpoint

CPU, F32 = torch.device("cpu"), torch.float32

# Printed by `scripts/reference_video_grids.py` in the side venv of scripts/sglang_compat.sh (transformers
# 5.23.0's Qwen2VLVideoProcessor via AutoVideoProcessor.from_pretrained(folder)): each clip's video_grid_thw.
EXPECTED_GRIDS = {
    'preprocessor_only': [(3, 4, 4), (2, 12, 18), (1, 4, 4), (2, 6, 34)],
    'video_preprocessor': [(3, 6, 8), (2, 8, 12), (1, 6, 6), (2, 4, 24)],
    'nested_processor_config': [(3, 8, 10), (2, 18, 26), (1, 8, 8), (2, 10, 50)],
    'processor_config_without_video': [(3, 6, 8), (2, 6, 8), (1, 6, 6), (2, 2, 16)],
    'video_config_without_size': [(2, 34, 46), (2, 20, 28)],
    'capped': [(1, 10, 14), (5, 4, 6), (16, 2, 4), (2, 4, 20)],
    'cap_disabled': [(1, 34, 46), (16, 34, 46)],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    _, processor, folder = qwen25_vl_checkpoint(tmp_path_factory.mktemp("qwen25vl_video"))
    # The checkpoint's own image processor has the pixel range the cases' preprocessor_config.json says.
    assert (processor.size.shortest_edge, processor.size.longest_edge) == (PREPROCESSOR["min_pixels"],
                                                                          PREPROCESSOR["max_pixels"])
    return folder


def clip(frames: int, width: int, height: int) -> list[Image.Image]:
    rng = np.random.default_rng(frames * width + height)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(frames)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_video_rows_equal_what_the_transformers_video_processor_gives(folder, case):
    files, clips = CASES[case]
    write_case(folder, files)
    adapter = load_checkpoint(folder, CPU, F32)
    for (frames, width, height), want in zip(clips, EXPECTED_GRIDS[case], strict=True):
        layout = adapter.item_layout("video", clip(frames, width, height))
        assert layout.grid_thw == want, (case, frames, width, height)
        assert layout.tokens == want[0] * want[1] * want[2] // 4
    small = [i for i, (frames, width, height) in enumerate(clips) if frames * width * height <= 5 * 640 * 480]
    items = [clip(*clips[i]) for i in small]
    batch = adapter.preprocess("video", items)
    assert [layout.grid_thw for layout in batch.layouts] == [EXPECTED_GRIDS[case][i] for i in small]
    assert adapter.forward(batch).shape[0] == batch.total_tokens


def test_the_issue_case_a_published_layout_gets_the_image_range_not_the_video_defaults(folder):
    # A published Qwen2.5-VL folder has only preprocessor_config.json; 5 frames of 70x50 are 3x4x4 there
    # (12 rows), where Qwen2-VL's video defaults would make 3x20x28 (420 rows).
    write_case(folder, {"preprocessor_config.json": PREPROCESSOR})
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.item_layout("video", clip(5, 70, 50)).tokens == 12


def test_image_settings_come_from_the_nested_processor_config_first(folder):
    from transformers import AutoImageProcessor

    nested = dict(PREPROCESSOR, min_pixels=6272, max_pixels=12544)
    write_case(folder, {"preprocessor_config.json": PREPROCESSOR,
                        "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor", "image_processor": nested}})
    try:
        adapter = load_checkpoint(folder, CPU, F32)
        reference = AutoImageProcessor.from_pretrained(folder)
    finally:
        write_case(folder, {"preprocessor_config.json": PREPROCESSOR})
    assert (adapter.min_pixels, adapter.max_pixels) == (6272, 12544)
    images = [clip(1, width, height)[0] for width, height in ((640, 480), (56, 56), (300, 90))]
    want = reference(images=images, return_tensors="pt")["image_grid_thw"].tolist()
    assert [list(adapter.item_layout("image", image).grid_thw) for image in images] == want
    assert want != AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")[
        "image_grid_thw"].tolist(), "the nested settings must make a difference in this test"


def test_video_processor_that_does_not_fit_the_tower_is_refused(folder):
    write_case(folder, {"preprocessor_config.json": PREPROCESSOR,
                        "video_preprocessor_config.json": {"patch_size": 16}})
    try:
        with pytest.raises(ValueError, match="video processor"):
            load_checkpoint(folder, CPU, F32)
    finally:
        write_case(folder, {"preprocessor_config.json": PREPROCESSOR})
    assert json.loads((folder / "preprocessor_config.json").read_text()) == PREPROCESSOR
