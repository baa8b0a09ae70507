"""MiniMax-M3 VL (`minimax_m3_vl`): its CLIP-like vision tower and patch-merging projector as one encoder
family, images and videos.

`MiniMaxM3VLModel.get_image_features` (`get_video_features` is the same call) embeds `14 x 14` patches over
`temporal_patch_size` (2) frames with a Conv3d, runs CLIP-style layers with 3-D rope (t, h, w) in which every
grid row attends within itself, then projects every patch to the text width and merges each `2 x 2` window
(4 consecutive patch rows, the processor's order) into one row: `t*h*w/4` rows per item.

- Images: the folder's `MiniMaxM3VLImageProcessor` (torchvision): Qwen-style `smart_resize` into
  `size.shortest_edge`..`size.longest_edge` pixels; grid `[1, h, w]`. One processor call and one forward for
  a batch (the tower packs the items and attends within each).
- Videos: the folder's `MiniMaxM3VLVideoProcessor` (torchvision) on each clip, frames as given, with its own
  per-frame `smart_resize` (`min_pixels`..`max_pixels`); the item's grid is `[t, h, w]`, `t` = frames / 2
  rounded up (last frame repeated). The processor cuts the clip into attention segments of
  `vision_segment_max_frames` temporal patches, and the tower gets those segment grids, as
  `get_video_features` does. The full `MiniMaxM3VLProcessor` calls its video processor with
  `do_resize=False` (its callers resize frames beforehand): for frames already whole merged patches within the
  pixel budget the two agree (the resize keeps their size), and the tests check that they do.

The prompt (`MiniMaxM3VLProcessor`, and SGLang's `MiniMaxM3VLProcessor.get_mm_data`) wraps an image's rows in
`]<]start of image[>[` .. `]<]end of image[>[`, and a video's rows frame by frame (`h*w/4` each, `t` frames),
each frame preceded by its time when the video's fps is known: a video's layout carries those times
(`video_timestamps`, each temporal patch at its first frame, `processors/video_clip.py`), from the frames the
server sampled.

Tensor parallel: the CLIP plan (`sharding/clip_towers.py`): heads and MLP columns split; patch embedding,
norms and projector stay whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ModelInfo
from encode_server.models.family import Family
from encode_server.models.layers.packed_attention import use_packed_attention_in_layers
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part
from processors.base import PreparedBatch
from processors.families.minimax_m3_vl import MiniMaxM3VLProcessor
from processors.torchvision_processors import load_processors


class MiniMaxM3VLAdapter(VisionPartAdapter):
    """Runs `MiniMaxM3VLModel.get_image_features` (vision tower + projector) on fused images or videos."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, processor: MiniMaxM3VLProcessor,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "minimax_m3_vl", model, config.text_config.hidden_size, processor, device, dtype)
        self.info = ModelInfo(name=name, family="minimax_m3_vl", modalities=("image", "video"),
                              hidden_size=int(config.text_config.hidden_size))
        self.packed_attention = use_packed_attention_in_layers(self.model.vision_tower, "self_attn")


    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = self.to_device(batch.inputs["pixel_values"])
        features = self.model.get_image_features(pixels, batch.inputs["grid_thw"].to(self.device))
        return self.flat_rows(features.pooler_output)

def check_consistent(config: Any, image_processor: Any, video_processor: Any) -> None:
    """Refuse processors whose patches, merging or temporal patches are not the vision tower's."""
    vision = config.vision_config
    for what, processor in (("image", image_processor), ("video", video_processor)):
        ours = (int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size))
        tower = (int(vision.patch_size), int(vision.spatial_merge_size), int(vision.temporal_patch_size))
        if ours != tower:
            raise CheckpointError(f"minimax_m3_vl: the {what} processor (patch, merge, temporal patch {ours}) "
                                  f"does not match the vision tower {tower}")



def minimax_m3_vl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> MiniMaxM3VLAdapter:
    """The vision tower and projector of a MiniMax-M3 VL checkpoint; the language model is never built."""
    from transformers import AutoConfig, MiniMaxM3VLModel

    folder = Path(folder)
    image_processor, video_processor = load_processors(folder, "minimax_m3_vl")
    config = AutoConfig.from_pretrained(folder)
    model = load_vision_part(folder, MiniMaxM3VLModel, config, device, dtype)
    check_consistent(config, image_processor, video_processor)
    return MiniMaxM3VLAdapter(folder.name, model, config, MiniMaxM3VLProcessor(image_processor, video_processor),
                              device, dtype)


def shard_minimax_m3_vl(adapter: MiniMaxM3VLAdapter, mesh: Any) -> None:
    """The CLIP plan on the tower's layers; projector and embeddings stay whole."""
    from encode_server.models.sharding.clip_towers import shard_clip_like_encoder

    shard_clip_like_encoder(adapter.model.vision_tower, mesh, "minimax_m3_vl")


FAMILY = Family(
    name="minimax_m3_vl",
    model_types=("minimax_m3_vl",),
    modalities=("image", "video"),
    row_formula="t*h*w/merge^2 per item (t = 1 for an image, frames/2 rounded up for a video)",
    grid_thw="[t, h, w] in patches of patch_size (14), before merging (one row per video, not per attention "
             "segment)",
    load=minimax_m3_vl_from_folder,
    shard=shard_minimax_m3_vl,
)
