"""Qwen3-VL (dense and MoE) and Qwen3.5 vision towers as one encoder family: images and videos.

The tower (`Qwen3VLVisionModel` and its MoE / Qwen3.5 twins) embeds `patch x patch` patches (16 in
the published models) with a learned position grid resampled to each item, runs its blocks, and
merges every `merge x merge` patches into one row of `out_hidden_size`. Qwen3-VL also returns
**deepstack** features: the hidden states after the blocks in `deepstack_visual_indexes`, each
through its own merger, which the language model adds to its first layers. Rows are shipped as
`torch.cat([main] + deepstack, dim=-1)`: `[tokens, out_hidden_size * (1 + k)]`, `k =
len(deepstack_visual_indexes)` (`ModelInfo.deepstack`). Qwen3.5's tower is the same one without
deepstack (`k = 0`).

Images: the folder's image processor (`Qwen2VLImageProcessorPil`), `1 x h x w` grids. Videos: the
folder's `Qwen3VLVideoProcessor` settings (its clip-wide `smart_resize`, the optional per-frame
pixel cap) applied by `VideoPatcher` without torchvision; a `t x h x w` grid, `t` = frames / 2
rounded up. The prompt names each temporal patch's time (`<t seconds>`): a video's layout carries
those seconds (`video_timestamps`), computed from the frames the server sampled as
`Qwen3VLProcessor` computes them (`processors/video_clip.py`), for the prefill side to rebuild the
prompt the model was trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.family import Family
from encode_server.models.towers.grid_vision import (
    GridVisionAdapter,
    deepstack_count,
    grid_adapter,
    load_grid_tower,
    run_qwen3_tower,
    shard_grid_blocks,
)
from processors.grid import GridProcessor, qwen_image_size_of
from processors.video_patches import VideoPatcher

BUILTIN_SEED = 1234

#: model_type -> (config class, vision tower class), both under `transformers.models`.
_TOWERS = {
    "qwen3_vl": ("qwen3_vl.configuration_qwen3_vl.Qwen3VLConfig",
                 "qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeConfig",
                     "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel"),
    "qwen3_5": ("qwen3_5.configuration_qwen3_5.Qwen3_5Config",
                "qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeConfig",
                    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel"),
}


def build_adapter(name: str, tower: torch.nn.Module, image_processor: Any, video_processor: Any,
                  device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    config = tower.config
    info = ModelInfo(name=name, family="qwen3_vl", modalities=("image", "video"),
                     hidden_size=int(config.out_hidden_size), deepstack=deepstack_count(config))
    processor = GridProcessor(image_processor, VideoPatcher(video_processor), qwen_image_size_of(image_processor),
                              video_timestamps=True)
    return grid_adapter(info, tower, processor, run_qwen3_tower, device, dtype)


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The vision tower (mergers included) of a Qwen3-VL / Qwen3.5 checkpoint; the language model is never built."""
    return load_grid_tower(folder, _TOWERS, "Qwen3-VL / Qwen3.5", lambda tower, images, videos: build_adapter(
        Path(folder).name, tower, images, videos, device, dtype), default_video_processor="Qwen3VLVideoProcessor")


def shard(adapter: EncoderAdapter, mesh: Any) -> None:
    """Attention heads and MLP columns split over the ranks; the mergers (deepstack ones too) stay whole."""
    shard_grid_blocks(adapter, mesh, colwise_mlp=("linear_fc1",), rowwise_mlp=("linear_fc2",))


def tiny_qwen3_vl(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """A built-in Qwen3-VL tower: 4 blocks of width 128, patch 16, merge 2, deepstack after blocks 1 and 2."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    config = Qwen3VLVisionConfig(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                                 patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                 num_position_embeddings=256, deepstack_visual_indexes=[1, 2])
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        tower = Qwen3VLVisionModel._from_config(config).float()
    # Up to 512x512 pixels per image (256 rows), and per frame of a video, keeping CPU forwards short.
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=64 * 64, max_pixels=512 * 512,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512 * 16},
                                            cap_pixels_per_frame=True, max_video_tokens=256,
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return build_adapter("tiny-qwen3-vl", tower, image_processor, video_processor, device, dtype)


FAMILY = Family(
    name="qwen3_vl",
    model_types=tuple(_TOWERS),
    modalities=("image", "video"),
    row_formula="t*h*w/merge^2 per item (t = 1 for an image, frames/2 rounded up for a video); "
                "each row is main + deepstack features: out_hidden_size * (1 + len(deepstack_visual_indexes)) wide",
    grid_thw="[t, h, w] in patches of patch_size (16), before merging",
    load=load,
    builtins={"tiny-qwen3-vl": tiny_qwen3_vl},
    shard=shard,
)
