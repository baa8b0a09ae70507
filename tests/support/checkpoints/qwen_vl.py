"""Tiny full Qwen2-VL and Qwen2.5-VL checkpoints (language model included), saved with `save_pretrained`;
their sizes and processor settings differ from the built-ins on purpose, so the loader has to read
everything from the folder."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import TEXT, as_resolved
from tests.support.tiny_parts import save_checkpoint as _save


def qwen25_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=3, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=96,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[2]),
    )
    torch.manual_seed(7)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    folder = _save(model, processor, folder, max_shard_size)
    return model, as_resolved(processor, folder), folder


def qwen2_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=96, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
    )
    torch.manual_seed(10)
    model = Qwen2VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 48)
    folder = _save(model, processor, folder, max_shard_size)
    return model, as_resolved(processor, folder), folder


QWEN_VL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def qwen_reference(model, processor, images) -> torch.Tensor:
    inputs = processor(images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_grid_thw=inputs["image_grid_thw"])
    return torch.cat(out.pooler_output)
