"""What `transformers`' own Qwen2-VL video processor makes of the video test cases: the reference grids.

`transformers`' `Qwen2VLVideoProcessor` needs torchvision, which the project's environment (and CI)
does not have, so the tests cannot call it. This script runs it once, in an environment that has
torchvision, on the cases in `CASES` (processor config files in a checkpoint folder, and clips of
given frame counts and sizes), and prints each clip's `video_grid_thw` and row count; those numbers
are committed in `tests/test_qwen_video_settings.py` as literal expectations.

    .sglang-venv/bin/python scripts/reference_video_grids.py
    # (the side venv of scripts/sglang_compat.sh: torch 2.14.1, torchvision 0.29.1, transformers 5.23.0)

`CASES` itself is plain data, imported by the test so that both sides use the same cases.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

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


def reference_grids() -> dict[str, list[tuple[int, int, int]]]:
    """Each case's clips through `AutoVideoProcessor.from_pretrained(folder)`: their `video_grid_thw`."""
    import numpy as np
    from transformers import AutoVideoProcessor

    grids = {}
    for name, (files, clips) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
            write_case(folder, files)
            processor = AutoVideoProcessor.from_pretrained(folder)
            assert type(processor).__name__ == "Qwen2VLVideoProcessor", type(processor)
            grids[name] = []
            for frames, width, height in clips:
                video = np.zeros((frames, height, width, 3), dtype=np.uint8)
                out = processor(videos=[video], return_tensors="pt")
                grids[name].append(tuple(int(v) for v in out["video_grid_thw"][0]))
    return grids


def main() -> None:
    import transformers

    print(f"# transformers {transformers.__version__}, python {sys.version.split()[0]}")
    print("EXPECTED_GRIDS = {")
    for name, grids in reference_grids().items():
        print(f"    {name!r}: {grids!r},")
    print("}")


if __name__ == "__main__":
    main()
