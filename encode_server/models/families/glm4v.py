"""GLM-4.1V / GLM-4.5V (`glm4v`, `glm4v_moe`) vision towers as one encoder family: images and videos.

The tower (`Glm4vVisionModel`, and its MoE twin) embeds `patch x patch` patches (14 in the published
models), adds a learned position grid resampled (bicubic) to each item, runs its blocks, and merges
every `merge x merge` patches with a strided convolution and an MLP into one row of
`out_hidden_size`: `t * h * w / merge^2` rows per item.

Images: the folder's `Glm4vImageProcessorPil` (its `smart_resize` counts an image as
`temporal_patch_size` frames), `1 x h x w` grids. Videos: the folder's `Glm4vVideoProcessor`
settings applied by `VideoPatcher` without torchvision; a `t x h x w` grid, `t` = frames / 2
rounded up. The tower sees a video as `t` separate one-group items (exactly as
`Glm4vModel.get_video_features` flattens `video_grid_thw`), so each temporal group gets its own
position grid. The frames are used as given: GLM's own frame sampling needs the video's fps, which
frames do not carry (`transformers` refuses frames without it unless `do_sample_frames=False`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.family import Family
from encode_server.models.towers.grid_vision import GridVisionAdapter, grid_adapter, load_grid_tower, shard_grid_blocks
from processors.grid import GridProcessor, glm4v_image_size_of
from processors.video_patches import VideoPatcher

BUILTIN_SEED = 1234

#: model_type -> (config class, vision tower class), both under `transformers.models`.
_TOWERS = {
    "glm4v": ("glm4v.configuration_glm4v.Glm4vConfig", "glm4v.modeling_glm4v.Glm4vVisionModel"),
    "glm4v_moe": ("glm4v_moe.configuration_glm4v_moe.Glm4vMoeConfig",
                  "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionModel"),
}


def run_glm4v_tower(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor, modality: str) -> torch.Tensor:
    """The tower's rows; a video's `[t, h, w]` becomes `t` rows of `[1, h, w]` first, as `get_video_features` does."""
    if modality == "video":
        frames_hw = torch.repeat_interleave(grid[:, 1:], grid[:, 0], dim=0)
        grid = torch.cat([frames_hw.new_ones(frames_hw.shape[0], 1), frames_hw], dim=1)
    return tower(pixels, grid_thw=grid).pooler_output


def build_adapter(name: str, tower: torch.nn.Module, image_processor: Any, video_processor: Any,
                  device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    info = ModelInfo(name=name, family="glm4v", modalities=("image", "video"),
                     hidden_size=int(tower.config.out_hidden_size))
    processor = GridProcessor(image_processor, VideoPatcher(video_processor), glm4v_image_size_of(image_processor))
    return grid_adapter(info, tower, processor, run_glm4v_tower, device, dtype)


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The vision tower (merger included) of a GLM-4.1V / 4.5V checkpoint; the language model is never built."""
    return load_grid_tower(folder, _TOWERS, "GLM-4V", lambda tower, images, videos: build_adapter(
        Path(folder).name, tower, images, videos, device, dtype), default_video_processor="Glm4vVideoProcessor")


def shard(adapter: EncoderAdapter, mesh: Any) -> None:
    """Attention heads and MLP columns split over the ranks; the patch merger stays whole."""
    shard_grid_blocks(adapter, mesh, colwise_mlp=("gate_proj", "up_proj"), rowwise_mlp=("down_proj",))


def tiny_glm4v(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """A built-in GLM-4V tower: 4 blocks of width 128, patch 14, merge 2, a 112-pixel position grid."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    config = Glm4vVisionConfig(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                               image_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        tower = Glm4vVisionModel._from_config(config).float()
    # Up to 448x448 pixels per image (256 rows), and per frame of a video, keeping CPU forwards short.
    image_processor = Glm4vImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 2 * 448 * 448})
    video_processor = Glm4vVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 16 * 448 * 448})
    return build_adapter("tiny-glm4v", tower, image_processor, video_processor, device, dtype)


FAMILY = Family(
    name="glm4v",
    model_types=tuple(_TOWERS),
    modalities=("image", "video"),
    row_formula="t*h*w/merge^2 per item (t = 1 for an image, frames/2 rounded up for a video)",
    grid_thw="[t, h, w] in patches of patch_size (14), before merging",
    load=load,
    builtins={"tiny-glm4v": tiny_glm4v},
    shard=shard,
)
