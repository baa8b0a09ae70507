"""Tiny Qwen3-VL / Qwen3.5 / GLM-4V checkpoint folders and media, shared by the tests and the reference script.

Importable in both the project's venv and the side venv that has torchvision (it needs only
numpy, PIL, tokenizers and transformers), so that `tools/reference/processor_reference.py` can run the
families' full `transformers` processors (which need torchvision) on exactly the folders and media
the tests use, and commit what they produce to `tests/data/processor_reference.json`.

Processor files come in the three layouts `transformers` reads (see `get_video_processor_dict`):
- `nested`: `processor_config.json` holding `image_processor` and `video_processor` (what v5 saves);
- `separate`: `preprocessor_config.json` + `video_preprocessor_config.json`;
- `image_only`: `preprocessor_config.json` only, so the video settings come from the image ones.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image

from tests.support.tiny_parts import TEXT, clip, random_image

LAYOUTS = ("nested", "separate", "image_only")


QWEN_ROPE = {"rope_type": "default", "mrope_section": [4, 4, 4], "rope_theta": 10000.0}


#: Small linear-attention (gated delta net) layers for the Qwen3.5 language models.
QWEN3_5_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4)


GLM_VISION = dict(depth=2, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=96, image_size=56,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)


QWEN3_VISION = dict(depth=3, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=96, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)


#: Per family: the model types it is tested with, its processor settings, and its prompt's tokens.
FAMILIES = {
    "qwen3_vl": {
        "model_types": ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
        "processor_class": "Qwen3VLProcessor",
        "image_processor": {
            "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
            "temporal_patch_size": 2, "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 20},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        },
        "video_processor": {
            "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "merge_size": 2,
            "temporal_patch_size": 2, "size": {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 2 * 24},
            "cap_pixels_per_frame": True, "max_video_tokens": 12,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        },
        "special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"],
        "image_prompt": "describe <|vision_start|><|image_pad|><|vision_end|> please",
        "video_prompt": "describe <|vision_start|><|video_pad|><|vision_end|> please",
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
    },
    "glm4v": {
        "model_types": ("glm4v", "glm4v_moe"),
        "processor_class": "Glm4vProcessor",
        "image_processor": {
            "image_processor_type": "Glm4vImageProcessor", "patch_size": 14, "merge_size": 2,
            "temporal_patch_size": 2, "size": {"shortest_edge": 28 * 28 * 2 * 2, "longest_edge": 28 * 28 * 2 * 18},
        },
        "video_processor": {
            "video_processor_type": "Glm4vVideoProcessor", "patch_size": 14, "merge_size": 2,
            "temporal_patch_size": 2, "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 2 * 20},
        },
        "special_tokens": ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>",
                           "<|begin_of_video|>", "<|end_of_video|>"],
        "image_prompt": "describe <|begin_of_image|><|image|><|end_of_image|> please",
        "video_prompt": "describe <|begin_of_video|><|video|><|end_of_video|> please",
        "image_token": "<|image|>",
        "video_token": "<|image|>",  # GLM-4V fills a video's frames with image tokens
    },
}


#: (width, height) of the test images: small (upscaled), wide, tall, large (downscaled), odd sizes.
IMAGE_SIZES = [(20, 30), (64, 64), (150, 70), (45, 190), (333, 250)]


#: (frames, width, height) of the test clips: even and odd frame counts, resized up and down.
CLIP_SIZES = [(2, 64, 64), (3, 100, 60), (4, 50, 150), (5, 300, 200)]


def sample_images() -> list[Image.Image]:
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]


def sample_clips() -> list[list[Image.Image]]:
    return [clip(n, w, h, 50 + seed) for seed, (n, w, h) in enumerate(CLIP_SIZES)]


def fingerprint(values) -> dict:
    """Enough of a float tensor to tell whether another computation produced the very same values."""
    array = np.ascontiguousarray(values.float().numpy(), dtype="<f4")
    flat = array.reshape(-1).astype(np.float64)
    picks = np.linspace(0, flat.size - 1, 16).round().astype(int)
    return {"shape": list(array.shape), "sum": float(flat.sum()), "abs_sum": float(np.abs(flat).sum()),
            "samples": {str(int(i)): float(flat[i]) for i in picks},
            "sha256": hashlib.sha256(array.tobytes()).hexdigest()}


def model_config(model_type: str):
    """The tiny full model's config (language model included) for a model type."""
    import transformers

    if model_type == "qwen3_vl":
        return transformers.Qwen3VLConfig(text_config=dict(TEXT, head_dim=24, rope_parameters=QWEN_ROPE),
                                          vision_config=dict(QWEN3_VISION, deepstack_visual_indexes=[0, 2]))
    if model_type == "qwen3_vl_moe":
        return transformers.Qwen3VLMoeConfig(
            text_config=dict(TEXT, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                             rope_parameters=QWEN_ROPE),
            vision_config=dict(QWEN3_VISION, deepstack_visual_indexes=[1]))
    if model_type == "qwen3_5":
        return transformers.Qwen3_5Config(
            text_config=dict(TEXT, **QWEN3_5_LINEAR, head_dim=24, rope_parameters=QWEN_ROPE),
            vision_config=QWEN3_VISION)
    if model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeConfig(
            text_config=dict(TEXT, **QWEN3_5_LINEAR, head_dim=24, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=48, shared_expert_intermediate_size=48, rope_parameters=QWEN_ROPE),
            vision_config=QWEN3_VISION)
    glm_rope = dict(QWEN_ROPE, partial_rotary_factor=0.5)
    if model_type == "glm4v":
        return transformers.Glm4vConfig(text_config=dict(TEXT, rope_parameters=glm_rope), vision_config=GLM_VISION)
    if model_type == "glm4v_moe":
        return transformers.Glm4vMoeConfig(
            text_config=dict(TEXT, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                             first_k_dense_replace=1, n_shared_experts=1, rope_parameters=glm_rope),
            vision_config=GLM_VISION)
    raise ValueError(model_type)


def family_of(model_type: str) -> str:
    return next(name for name, spec in FAMILIES.items() if model_type in spec["model_types"])


def save_tokenizer(folder: Path, family: str) -> None:
    """A word-level tokenizer that knows the family's special tokens (no download needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = FAMILIES[family]["special_tokens"]
    words = ["<|endoftext|>", "[UNK]", *specials, "describe", "please"]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=specials)
    tokenizer.save_pretrained(folder)


def write_processor_files(folder: Path, model_type: str, layout: str) -> Path:
    """The family's processor settings (and tokenizer, and `config.json`) in one of the `LAYOUTS`."""
    family = family_of(model_type)
    spec = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    image_settings, video_settings = dict(spec["image_processor"]), dict(spec["video_processor"])
    if layout == "nested":
        nested = {"processor_class": spec["processor_class"], "image_processor": image_settings,
                  "video_processor": video_settings}
        (folder / "processor_config.json").write_text(json.dumps(nested, indent=2))
    elif layout in ("separate", "image_only"):
        (folder / "preprocessor_config.json").write_text(json.dumps(image_settings, indent=2))
        if layout == "separate":
            (folder / "video_preprocessor_config.json").write_text(json.dumps(video_settings, indent=2))
    else:
        raise ValueError(layout)
    save_tokenizer(folder, family)
    if not (folder / "config.json").is_file():
        model_config(model_type).save_pretrained(folder)
    return folder


def build_model(model_type: str, seed: int):
    """The tiny full model for a model type, from a fixed seed, in eval mode (float32)."""
    import torch
    import transformers

    classes = {"qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
               "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
               "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
               "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
               "glm4v": transformers.Glm4vForConditionalGeneration,
               "glm4v_moe": transformers.Glm4vMoeForConditionalGeneration}
    torch.manual_seed(seed)
    return classes[model_type](model_config(model_type)).eval()


def checkpoint_folders(root: Path, model_type: str, seed: int):
    """The tiny model saved once, and one folder per layout holding its weights and processor files."""
    import shutil

    model = build_model(model_type, seed)
    weights = root / f"{model_type}-weights"
    model.save_pretrained(weights)
    folders = {}
    for layout in LAYOUTS:
        folder = root / f"{model_type}-{layout}"
        shutil.copytree(weights, folder)
        folders[layout] = write_processor_files(folder, model_type, layout)
    return model, folders
