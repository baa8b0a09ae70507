"""A tiny full LLaVA-OneVision checkpoint, and its full processor without the video processor:
`transformers` 5.23 requires a torchvision video processor for `LlavaOnevisionProcessor`, so it is built with
its image processor and tokenizer only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.tiny_parts import TEXT_WORDS, small_text, word_tokenizer

ONEVISION_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [84, 84]]


def llava_onevision_checkpoint(folder: Path, tower: str = "siglip_vision_model", strategy: str = "full"):
    """LLaVA-OneVision: 28x28 tiles of 4x4 patches, up to 3x3 tiles, anyres_max_2."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tokenizer = word_tokenizer(TEXT_WORDS, ["<image>", "<video>"], {"image_token": "<image>", "video_token": "<video>"})
    config = LlavaOnevisionConfig(
        text_config=small_text(model_type="qwen2"),
        vision_config=dict(model_type=tower, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, image_size=28, patch_size=7),
        image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
        image_grid_pinpoints=ONEVISION_PINPOINTS, vision_feature_select_strategy=strategy, vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_2",
    )
    torch.manual_seed(12)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                      image_grid_pinpoints=ONEVISION_PINPOINTS)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    # What LlavaOnevisionProcessor.save_pretrained writes (it cannot be built here: see the module docstring).
    num_image_tokens = 16 + (1 if tower == "clip_vision_model" else 0)  # CLIP's class token counts here
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": num_image_tokens,
        "vision_feature_select_strategy": strategy, "vision_aspect_ratio": "anyres_max_2"}))
    return model, folder


def llava_onevision_processor(folder: Path):
    """`LlavaOnevisionProcessor` from the folder, with its image processor and tokenizer (no video processor)."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyLlavaOnevisionProcessor.from_pretrained(folder)
