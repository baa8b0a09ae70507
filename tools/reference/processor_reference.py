"""Regenerate `tests/data/processor_reference.json`: what `transformers`' own full processors produce.

The Qwen3-VL and GLM-4V processors need torchvision for their video processors, which the
project's venv does not have, so this runs in a Python that has it (torch + torchvision +
transformers), on the very folders and media of `tests/support/checkpoints/grid_vision.py`:

    # in the side venv that tools/compat/sglang_compat.sh builds:
    PYTHONPATH=$PWD .sglang-venv/bin/python tools/reference/processor_reference.py

For every tested model type and processor-file layout it records, per test image and clip, the
number of placeholder tokens `AutoProcessor.from_pretrained(folder)` inserts into `input_ids` (the
prefill side's count), the grid, and for clips a fingerprint of `pixel_values_videos` (shape, sums,
sampled values, SHA-256 of the float32 bytes). Clips go in as frames with `do_sample_frames=False`:
the frames are the sampled video (see `processors/video_patches.py`).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.checkpoints.grid_vision import (  # noqa: E402  (needs the path above)
    CLIP_SIZES,
    FAMILIES,
    IMAGE_SIZES,
    LAYOUTS,
    family_of,
    fingerprint,
    sample_clips,
    sample_images,
    write_processor_files,
)

OUTPUT = ROOT / "tests" / "data" / "processor_reference.json"
MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe")


def reference_for(folder: Path, model_type: str) -> dict:
    from transformers import AutoProcessor

    spec = FAMILIES[family_of(model_type)]
    processor = AutoProcessor.from_pretrained(folder)
    image_token = processor.tokenizer.convert_tokens_to_ids(spec["image_token"])
    video_token = processor.tokenizer.convert_tokens_to_ids(spec["video_token"])
    record = {"processor": type(processor).__name__, "video_processor": type(processor.video_processor).__name__,
              "images": [], "videos": []}
    for (width, height), picture in zip(IMAGE_SIZES, sample_images(), strict=True):
        out = processor(text=[spec["image_prompt"]], images=[picture], return_tensors="pt")
        record["images"].append({"size": [width, height], "tokens": int((out["input_ids"] == image_token).sum()),
                                 "grid_thw": out["image_grid_thw"][0].tolist()})
    for (frames, width, height), video in zip(CLIP_SIZES, sample_clips(), strict=True):
        out = processor(text=[spec["video_prompt"]], videos=[video], do_sample_frames=False, return_tensors="pt")
        record["videos"].append({"frames": frames, "size": [width, height],
                                 "tokens": int((out["input_ids"] == video_token).sum()),
                                 "grid_thw": out["video_grid_thw"][0].tolist(),
                                 "pixels": fingerprint(out["pixel_values_videos"])})
    return record


def main() -> None:
    import torch
    import torchvision
    import transformers

    reference = {"generated_with": {"torch": torch.__version__, "torchvision": torchvision.__version__,
                                    "transformers": transformers.__version__},
                 "folders": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in MODEL_TYPES:
            for layout in LAYOUTS:
                folder = write_processor_files(Path(tmp) / f"{model_type}-{layout}", model_type, layout)
                reference["folders"][f"{model_type}/{layout}"] = reference_for(folder, model_type)
                print(f"{model_type}/{layout}: done", flush=True)
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
