"""Qwen processor settings come from where `transformers` takes them, and videos get its rows.

The video processor's settings are resolved as `get_video_processor_dict` does (nested
`video_processor` of processor_config.json, then video_preprocessor_config.json, then
preprocessor_config.json), with `Qwen2VLVideoProcessor`'s per-frame token cap. Each case's clips are
compared with what that processor itself (`AutoVideoProcessor.from_pretrained(folder)`, torchvision's)
gives in this environment: the grids and the pixel values.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.models.registry import load_checkpoint
from tests.support.checkpoints.qwen_vl import qwen25_vl_checkpoint

pytestmark = pytest.mark.quick

CPU, F32 = torch.device("cpu"), torch.float32

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

#: The usual layout of a published Qwen2.5-VL folder: legacy `min_pixels`/`max_pixels` keys.
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                "min_pixels": 3136, "max_pixels": 50176, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": MEAN, "image_std": STD}

#: Clips as (frames, width, height).
CLIPS = [(5, 70, 50), (4, 640, 480), (2, 56, 56), (3, 1000, 200)]

#: name -> (the folder's processor files, the clips to run)
CASES: dict[str, tuple[dict[str, dict], list[tuple[int, int, int]]]] = {
    # Only preprocessor_config.json: the video processor takes the image processor's settings.
    "preprocessor_only": ({"preprocessor_config.json": PREPROCESSOR}, CLIPS),
    # video_preprocessor_config.json wins over preprocessor_config.json.
    "video_preprocessor": ({
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor",
                                           "size": {"shortest_edge": 6272, "longest_edge": 25088},
                                           "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
    }, CLIPS),
    # The nested `video_processor` of processor_config.json wins over both files.
    "nested_processor_config": ({
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor",
                                           "size": {"shortest_edge": 6272, "longest_edge": 25088}},
        "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor",
                                  "video_processor": {"video_processor_type": "Qwen2VLVideoProcessor",
                                                      "size": {"shortest_edge": 12544, "longest_edge": 100352},
                                                      "patch_size": 14, "temporal_patch_size": 2,
                                                      "merge_size": 2}},
    }, CLIPS),
    # A processor_config.json without a nested video processor falls through to the video file
    # (legacy `min_pixels`/`max_pixels` keys there).
    "processor_config_without_video": ({
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor",
                                           "min_pixels": 6272, "max_pixels": 12544},
        "processor_config.json": {"processor_class": "Qwen2_5_VLProcessor"},
    }, CLIPS),
    # A video config without a pixel range: the video processor's class defaults apply.
    "video_config_without_size": ({
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor"},
    }, [(4, 640, 480), (3, 70, 50)]),
    # The per-frame cap: each frame gets an even share of max_video_tokens' pixels, floored at
    # 1.05 * shortest_edge; the same frame size gives fewer rows per frame as frames are added.
    "capped": ({
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor",
                                           "size": {"shortest_edge": 3136, "longest_edge": 602112},
                                           "cap_pixels_per_frame": True, "max_video_tokens": 50},
    }, [(2, 640, 480), (9, 640, 480), (32, 640, 480), (4, 1000, 200)]),
    # cap_pixels_per_frame false: no total bound, only the per-frame range.
    "cap_disabled": ({
        "preprocessor_config.json": PREPROCESSOR,
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor",
                                           "size": {"shortest_edge": 3136, "longest_edge": 602112},
                                           "cap_pixels_per_frame": False, "max_video_tokens": 50},
    }, [(2, 640, 480), (32, 640, 480)]),
}


def write_case(folder: Path, files: dict[str, dict]) -> None:
    """The case's processor files in `folder` (any other processor file removed)."""
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
        (folder / name).unlink(missing_ok=True)
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))


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
    from transformers import AutoVideoProcessor

    files, clips = CASES[case]
    write_case(folder, files)
    adapter = load_checkpoint(folder, CPU, F32)
    reference = AutoVideoProcessor.from_pretrained(folder)
    assert type(reference).__name__ == "Qwen2VLVideoProcessor", type(reference)
    small = [i for i, (frames, width, height) in enumerate(clips) if frames * width * height <= 5 * 640 * 480]
    for index, (frames, width, height) in enumerate(clips):
        video = clip(frames, width, height)
        want = reference(videos=[video], do_sample_frames=False, return_tensors="pt")
        grid = tuple(want["video_grid_thw"][0].tolist())
        layout = adapter.processor.item_layout("video", video)
        assert layout.grid_thw == grid, (case, frames, width, height)
        assert layout.tokens == grid[0] * grid[1] * grid[2] // 4
        if index in small:
            assert torch.equal(adapter.processor.preprocess("video", [video]).inputs["pixel_values"],
                               want["pixel_values_videos"]), (case, frames, width, height)
    batch = adapter.processor.preprocess("video", [clip(*clips[i]) for i in small])
    assert adapter.forward(batch).shape[0] == batch.total_tokens


def test_the_issue_case_a_published_layout_gets_the_image_range_not_the_video_defaults(folder):
    # A published Qwen2.5-VL folder has only preprocessor_config.json; 5 frames of 70x50 are 3x4x4 there
    # (12 rows), where Qwen2-VL's video defaults would make 3x20x28 (420 rows).
    write_case(folder, {"preprocessor_config.json": PREPROCESSOR})
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.processor.item_layout("video", clip(5, 70, 50)).tokens == 12


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
    assert (adapter.processor.image_size.keywords["min_pixels"],
            adapter.processor.image_size.keywords["max_pixels"]) == (6272, 12544)
    images = [clip(1, width, height)[0] for width, height in ((640, 480), (56, 56), (300, 90))]
    want = reference(images=images, return_tensors="pt")["image_grid_thw"].tolist()
    assert [list(adapter.processor.item_layout("image", image).grid_thw) for image in images] == want
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
