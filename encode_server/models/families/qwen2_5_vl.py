"""The qwen2_5_vl family (Qwen2.5-VL vision tower and merger), and the Qwen-grid parts Qwen2-VL shares.

An image of `h x w` pixels is resized to multiples of `patch_size * merge_size` (within the image
processor's pixel range), cut into a `1 x gh x gw` grid of patches, and every `merge_size^2` patches
merge into one output row: `gh * gw / merge_size^2` rows. A video is a list of frames prepared by the
folder's video processor (`Qwen2VLVideoProcessor`, through `VideoPatcher`: its per-frame
`smart_resize` with the video pixel range, torchvision's resize, `temporal_patch_size` frames per
temporal patch, the last frame repeated to fill the final group): a `t x gh x gw` grid.

The adapter is the shared `GridVisionAdapter`; the tower attends within each image or video (and its
windows) only, so an item's rows do not depend on the items fused beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.builtin import seeded
from encode_server.models.family import Family
from encode_server.models.towers.grid_vision import (
    GridVisionAdapter,
    grid_adapter,
    load_grid_tower,
    run_qwen_tower,
    shard_grid_blocks,
)
from processors.grid import GridProcessor, qwen_image_size_of
from processors.video_patches import VideoPatcher, qwen2_vl_video_settings_class

#: model_type -> (config class, vision tower class), both under `transformers.models`.
_TOWERS = {
    "qwen2_5_vl": ("qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLConfig",
                   "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen2_vl": ("qwen2_vl.configuration_qwen2_vl.Qwen2VLConfig",
                 "qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel"),
}

_NAMES = {"qwen2_5_vl": "Qwen2.5-VL", "qwen2_vl": "Qwen2-VL"}


def build_adapter(name: str, family: str, tower: torch.nn.Module, image_processor: Any, video_processor: Any,
                  device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    config = tower.config
    # Qwen2.5-VL names the merger's output width `out_hidden_size`; Qwen2-VL calls it `hidden_size`.
    width = getattr(config, "out_hidden_size", None) or config.hidden_size
    info = ModelInfo(name=name, family=family, modalities=("image", "video"), hidden_size=int(width))
    processor = GridProcessor(image_processor, VideoPatcher(video_processor), qwen_image_size_of(image_processor))
    return grid_adapter(info, tower, processor, run_qwen_tower, device, dtype)


def load_qwen_vision(folder: Path, device: torch.device, dtype: torch.dtype, family: str) -> EncoderAdapter:
    """A Qwen2-VL or Qwen2.5-VL vision tower (`visual.*` in the checkpoint) with the folder's image and video
    processors, each resolved as `transformers` resolves it; the language model is never built."""
    def build(tower: torch.nn.Module, images: Any, videos: Any) -> GridVisionAdapter:
        return build_adapter(Path(folder).name, family, tower, images, videos, device, dtype)

    return load_grid_tower(folder, {family: _TOWERS[family]}, _NAMES[family], build,
                           default_video_processor="Qwen2VLVideoProcessor")


def qwen25_vl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The vision tower and merger of a Qwen2.5-VL checkpoint."""
    return load_qwen_vision(folder, device, dtype, "qwen2_5_vl")


def tiny_qwen25_vl(device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    """`tiny-qwen2.5-vl`: 4 blocks, width 128, patch 14, merge 2; 56x56 to 448x448 pixels per image or frame."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1, 3],
    )
    config._attn_implementation = "sdpa"
    tower = seeded(lambda: Qwen2_5_VisionTransformerPretrainedModel._from_config(config).float())
    # Up to 448x448 pixels per image or frame: at most 256 rows each, which keeps CPU forwards short.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    video_processor = qwen2_vl_video_settings_class()(size={"shortest_edge": 56 * 56, "longest_edge": 448 * 448})
    return build_adapter("tiny-qwen2.5-vl", "qwen2_5_vl", tower, image_processor, video_processor, device, dtype)


def shard_qwen25_vl(adapter: EncoderAdapter, mesh: Any) -> None:
    """Every block: fused `qkv` reordered then column-wise, `proj` row-wise, the gated MLP column- then row-wise."""
    shard_grid_blocks(adapter, mesh, colwise_mlp=("gate_proj", "up_proj"), rowwise_mlp=("down_proj",))


FAMILY = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    modalities=("image", "video"),
    row_formula="`t*h*w / merge^2`",
    grid_thw="the tower's patch grid; `t` = 1 for an image, frames / temporal patch for a video (last frame repeated)",
    load=qwen25_vl_from_folder,
    builtins={"tiny-qwen2.5-vl": tiny_qwen25_vl},
    shard=shard_qwen25_vl,
)
