"""The prefill side's placeholder counts for the vision families, from their FULL processors: the reference.

The prefill node splices an item's rows in place of the placeholder tokens its processor
(`AutoProcessor.from_pretrained(folder)`) inserted into `input_ids`, so the encoder's row count
must equal that number. The full processors of qwen2_5_vl, qwen2_vl and internvl hold a video
processor, which needs torchvision (absent from the project's environment and CI), so this script
runs them once in an environment that has it:

    .sglang-venv/bin/python tools/reference/reference_prefill_counts.py
    # (the side venv of tools/compat/sglang_compat.sh: torch 2.14.1, torchvision 0.29.1, transformers 5.23.0)

For each family it builds the tiny checkpoint of `tests/support/checkpoints/`, saves the full processor
(image processor, video processor, a tiny tokenizer) into it with `save_pretrained`, loads it back
with `AutoProcessor.from_pretrained(folder)`, and counts the image (video) placeholder tokens in
`input_ids` for prompts holding one item each. It writes `tests/data/prefill_reference.json`: the
processor config files as saved (the tests put them into their own copy of the checkpoint) and the
counts, which `tests/models/test_prefill_counts.py` and `tests/models/test_qwen2_vl.py` assert.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "tests" / "data" / "prefill_reference.json"
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")

#: Images as (width, height); videos as (frames, width, height).
QWEN_IMAGES = [(56, 56), (90, 40), (130, 200), (28, 300), (640, 480), (1000, 200)]
QWEN_VIDEOS = [(5, 70, 50), (4, 640, 480), (2, 56, 56), (9, 320, 240), (1, 100, 100)]
INTERNVL_IMAGES = [(40, 40), (160, 50), (90, 90), (30, 120), (640, 480), (200, 1000)]


def qwen_full_processor(processor_class: str, image_processor, video_settings: dict):
    import transformers
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from tests.support.checkpoints.qwen_vl import QWEN_VL_TOKENS
    from tests.support.tiny_parts import tiny_tokenizer

    video_processor = Qwen2VLVideoProcessor(**video_settings)
    return getattr(transformers, processor_class)(image_processor=image_processor, tokenizer=tiny_tokenizer(
        plain=QWEN_VL_TOKENS), video_processor=video_processor)


def internvl_full_processor(model, image_processor):
    from transformers import InternVLProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    from tests.support.checkpoints.internvl import INTERNVL_TOKENS
    from tests.support.tiny_parts import tiny_tokenizer

    vision = model.config.vision_config
    tokens_per_tile = int((vision.image_size[0] // vision.patch_size[0]) ** 2 * model.config.downsample_ratio ** 2)
    video_processor = InternVLVideoProcessor(size={"height": vision.image_size[0], "width": vision.image_size[1]})
    return InternVLProcessor(image_processor=image_processor, tokenizer=tiny_tokenizer(INTERNVL_TOKENS),
                             video_processor=video_processor, image_seq_length=tokens_per_tile)


def families() -> dict:
    from tests.support.checkpoints.internvl import internvl_checkpoint
    from tests.support.checkpoints.qwen_vl import qwen2_vl_checkpoint, qwen25_vl_checkpoint

    return {
        # The video range differs from the image range, and is saved in the nested processor_config.json.
        "qwen2_5_vl": (qwen25_vl_checkpoint, lambda model, image: qwen_full_processor(
            "Qwen2_5_VLProcessor", image, {"min_pixels": 28 * 28 * 8, "max_pixels": 28 * 28 * 48}),
            QWEN_IMAGES, QWEN_VIDEOS),
        # With the per-frame cap, binding for the longer clips.
        "qwen2_vl": (qwen2_vl_checkpoint, lambda model, image: qwen_full_processor(
            "Qwen2VLProcessor", image, {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 256,
                                        "cap_pixels_per_frame": True, "max_video_tokens": 120}),
            QWEN_IMAGES, QWEN_VIDEOS),
        "internvl": (internvl_checkpoint, internvl_full_processor, INTERNVL_IMAGES, []),
    }


def count_placeholders(processor, modality: str, item) -> int:
    """Placeholder tokens the full processor puts in `input_ids` for a prompt with this one item."""
    if type(processor).__name__ == "InternVLProcessor":
        prompt, token_id = f"describe {processor.image_token} please", processor.image_token_id
    elif modality == "image":
        prompt, token_id = "describe <|vision_start|><|image_pad|><|vision_end|> please", processor.image_token_id
    else:
        prompt, token_id = "describe <|vision_start|><|video_pad|><|vision_end|> please", processor.video_token_id
    inputs = {"images": [item]} if modality == "image" else {"videos": [item]}
    out = processor(text=[prompt], return_tensors="pt", **inputs)
    return int((out["input_ids"] == token_id).sum())


def reference() -> dict:
    import numpy as np
    from transformers import AutoProcessor

    rng = np.random.default_rng(0)
    result = {}
    for name, (build, full_processor, images, videos) in families().items():
        with tempfile.TemporaryDirectory() as tmp:
            model, image_processor, folder = build(Path(tmp) / name)
            for file in PROCESSOR_FILES:
                (folder / file).unlink(missing_ok=True)
            full_processor(model, image_processor).save_pretrained(folder)
            processor = AutoProcessor.from_pretrained(folder)
            entry = {"processor": type(processor).__name__,
                     "files": {file: json.loads((folder / file).read_text())
                               for file in PROCESSOR_FILES if (folder / file).is_file()},
                     "images": [], "videos": []}
            for width, height in images:
                image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                entry["images"].append([width, height, count_placeholders(processor, "image", image)])
            for frames, width, height in videos:
                video = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
                entry["videos"].append([frames, width, height, count_placeholders(processor, "video", video)])
            result[name] = entry
    return result


def main() -> None:
    import torch
    import torchvision
    import transformers

    sys.path.insert(0, str(ROOT))
    data = {"_produced_by": f"tools/reference/reference_prefill_counts.py with transformers "
                            f"{transformers.__version__}, torch {torch.__version__}, "
                            f"torchvision {torchvision.__version__}",
            **reference()}
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(json.dumps(data, indent=1) + "\n")
    for name, entry in data.items():
        if not name.startswith("_"):
            print(name, entry["processor"], "images", [c for *_, c in entry["images"]],
                  "videos", [c for *_, c in entry["videos"]])


if __name__ == "__main__":
    main()
