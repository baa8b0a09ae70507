"""A tiny full InternVL checkpoint (language model included), saved with `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import TEXT, as_resolved
from tests.support.tiny_parts import save_checkpoint as _save


def internvl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    config = InternVLConfig(
        vision_config=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
                           image_size=[42, 42], patch_size=[7, 7]),
        text_config=dict(TEXT, model_type="qwen2"),
        downsample_ratio=0.5,
    )
    torch.manual_seed(8)
    model = InternVLForConditionalGeneration(config).eval()
    processor = GotOcr2ImageProcessorPil(size={"height": 42, "width": 42}, crop_to_patches=True, min_patches=1,
                                         max_patches=4)
    folder = _save(model, processor, folder, max_shard_size)
    return model, as_resolved(processor, folder), folder


INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}


def internvl_reference(model, processor, images) -> torch.Tensor:
    inputs = processor(images=images, return_tensors="pt")
    config = model.config
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             vision_feature_layer=config.vision_feature_layer,
                                             vision_feature_select_strategy=config.vision_feature_select_strategy)
    return out.pooler_output.reshape(-1, out.pooler_output.shape[-1])
