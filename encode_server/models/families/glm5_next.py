"""GLM-5-Next (`glm5_next`) vision tower as one encoder family: images and videos.

The tower (`Glm5NextVisionModel`) has GLM-4V's interface and shape: `patch x patch` patches (14) embedded by
a Conv3d over `temporal_patch_size` frames, blocks with a fused `qkv` (plus per-head q/k RMS norms) and a
gated MLP, a strided-convolution downsample and a merger, so every `merge x merge` patches become one row of
`out_hidden_size`: `t * h * w / merge^2` rows per item. Its positions are 2-D rope only (no learned grid).
`GridVisionAdapter` (`towers/grid_vision.py`) runs it, on what
`processors/families/glm5_next.py` prepares, as it runs GLM-4V's, and the tensor-parallel plan
is GLM-4V's.

What `Glm5NextModel.get_image_features` / `get_video_features` are given, we give it:
- images: the folder's image processor (`Glm5NextImageProcessor`, torchvision), which resizes an image into a
  budget of `min_image_tokens` .. `max_image_tokens` rows and pads it onto a canvas of whole merged patches;
  `1 x h x w` grids, one processor call for a batch;
- videos: the folder's `Glm5NextVideoProcessor` (torchvision) on each clip, frames as given
  (`do_sample_frames=False`: its own sampling needs the file's fps); a `t x h x w` grid, `t` = frames / 2
  rounded up, and the tower sees a video as `t` one-group items, as `get_video_features` flattens it.

The prompt the prefill side builds fills a video's frames with image tokens, each frame wrapped in
`<|begin_of_image|>` .. `<|end_of_image|>` and followed by its time; SGLang's prefill reads only the grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.families.glm4v import run_glm4v_tower
from encode_server.models.family import Family
from encode_server.models.towers.grid_vision import GridVisionAdapter, grid_adapter, load_grid_tower, shard_grid_blocks
from processors.families.glm5_next import glm5_next_processor
from processors.torchvision_processors import load_processors

_TOWERS = {"glm5_next": ("glm5_next.configuration_glm5_next.Glm5NextConfig",
                         "glm5_next.modeling_glm5_next.Glm5NextVisionModel")}


def build_adapter(name: str, tower: torch.nn.Module, image_processor: Any, video_processor: Any,
                  device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    info = ModelInfo(name=name, family="glm5_next", modalities=("image", "video"),
                     hidden_size=int(tower.config.out_hidden_size))
    return grid_adapter(info, tower, glm5_next_processor(image_processor, video_processor), run_glm4v_tower,
                        device, dtype)


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The vision tower (downsample and merger included) of a GLM-5-Next checkpoint; the language model is never
    built. Its processors need torchvision."""
    image_processor, video_processor = load_processors(Path(folder), "glm5_next")
    return load_grid_tower(folder, _TOWERS, "GLM-5-Next", lambda tower, images, videos: build_adapter(
        Path(folder).name, tower, images, videos, device, dtype), default_video_processor="Glm5NextVideoProcessor",
        processors=(image_processor, video_processor))


def shard(adapter: EncoderAdapter, mesh: Any) -> None:
    """Attention heads and MLP columns split over the ranks (GLM-4V's plan); downsample and merger stay whole."""
    shard_grid_blocks(adapter, mesh, colwise_mlp=("gate_proj", "up_proj"), rowwise_mlp=("down_proj",))


FAMILY = Family(
    name="glm5_next",
    model_types=tuple(_TOWERS),
    modalities=("image", "video"),
    row_formula="t*h*w/merge^2 per item (t = 1 for an image, frames/2 rounded up for a video); an image is padded "
                "onto a canvas of `min_image_tokens`..`max_image_tokens` rows",
    grid_thw="[t, h, w] in patches of patch_size (14), before merging (the padded canvas)",
    load=load,
    shard=shard,
)
