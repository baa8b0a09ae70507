"""Built-in tiny models: real `transformers` encoder architectures from small configs and a fixed seed.

They need no download, and two processes (or two ranks) that build the same name hold bit-identical
weights, because the weights come from `torch.manual_seed(BUILTIN_SEED)` on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import EncoderAdapter

BUILTIN_SEED = 1234


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build a module on the CPU in float32 from a fixed seed, without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        return build().float().eval()


def tiny_qwen25_vl(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """Qwen2.5-VL vision tower and merger: 4 blocks of width 128, patch 14, merge 2, 128-d output."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .qwen_vl import QwenVisionAdapter

    config = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1, 3],
    )
    config._attn_implementation = "sdpa"
    tower = _seeded(lambda: Qwen2_5_VisionTransformerPretrainedModel._from_config(config))
    # Up to 448x448 pixels per image: at most 256 output rows, which keeps CPU forwards short.
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    return QwenVisionAdapter("tiny-qwen2.5-vl", tower, processor, device, dtype)


BUILTIN_MODELS: dict[str, Callable[[torch.device, torch.dtype], EncoderAdapter]] = {
    "tiny-qwen2.5-vl": tiny_qwen25_vl,
}
