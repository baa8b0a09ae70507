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
(`video_timestamps`, each temporal patch at its first frame, `inputs/video_clip.py`), from the frames the
server sampled.

Tensor parallel: the CLIP plan (`sharding/clip_towers.py`): heads and MLP columns split; patch embedding,
norms and projector stay whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ItemError, ItemLayout, ModelInfo, PreparedBatch
from encode_server.models.family import Family
from encode_server.models.inputs.torchvision_processors import check_clip, load_processors, process_clip
from encode_server.models.inputs.video_clip import clip_timestamps, first_frame_timestamps
from encode_server.models.layers.packed_attention import use_packed_attention_in_layers
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, as_images, load_vision_part


def _resized(height: int, width: int, *, do_resize: bool, factor: int, min_pixels: int,
             max_pixels: int) -> tuple[int, int]:
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import smart_resize

    if do_resize:
        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if height % factor or width % factor:
        raise ValueError(f"not whole {factor}-pixel merged patches and the processor does not resize")
    return height, width


class MiniMaxM3VLAdapter(VisionPartAdapter):
    """Runs `MiniMaxM3VLModel.get_image_features` (vision tower + projector) on fused images or videos."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, image_processor: Any, video_processor: Any,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "minimax_m3_vl", model, config.text_config.hidden_size, device, dtype)
        self.info = ModelInfo(name=name, family="minimax_m3_vl", modalities=("image", "video"),
                              hidden_size=int(config.text_config.hidden_size))
        vision = config.vision_config
        for what, processor in (("image", image_processor), ("video", video_processor)):
            ours = (int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size))
            tower = (int(vision.patch_size), int(vision.spatial_merge_size), int(vision.temporal_patch_size))
            if ours != tower:
                raise CheckpointError(f"minimax_m3_vl: the {what} processor (patch, merge, temporal patch {ours}) "
                                      f"does not match the vision tower {tower}")
        self.packed_attention = use_packed_attention_in_layers(self.model.vision_tower, "self_attn")
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.patch = int(vision.patch_size)
        self.merge_area = int(vision.spatial_merge_size) ** 2
        self.temporal = int(vision.temporal_patch_size)
        factor = self.patch * int(vision.spatial_merge_size)
        size = image_processor.size
        self.image_size = {"do_resize": bool(image_processor.do_resize), "factor": factor,
                           "min_pixels": int(size.shortest_edge), "max_pixels": int(size.longest_edge)}
        self.frame_size = {"do_resize": bool(video_processor.do_resize), "factor": factor,
                           "min_pixels": int(video_processor.min_pixels),
                           "max_pixels": int(video_processor.max_pixels)}

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "video":
            frames = check_clip(item)
            width, height = frames[0].size
            count, sizing = -(-len(frames) // self.temporal), self.frame_size
        else:
            (image,) = as_images([item])
            width, height = image.size
            count, sizing = 1, self.image_size
        try:
            height, width = _resized(height, width, **sizing)
        except ValueError as exc:
            raise ItemError(f"{modality} of {width}x{height} pixels: {exc}") from None
        grid = (count, height // self.patch, width // self.patch)
        timestamps = clip_timestamps(item, self.temporal, first_frame_timestamps) if modality == "video" else None
        return ItemLayout(tokens=grid[0] * grid[1] * grid[2] // self.merge_area, grid_thw=grid,
                          video_timestamps=timestamps)

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        layouts = [self.item_layout(modality, item) for item in items]  # one bad item must not fail the call
        if modality == "video":
            clips = [process_clip(self.video_processor, frames) for frames in items]
            pixels = torch.cat([clip["pixel_values_videos"] for clip in clips])
            grid = torch.cat([clip["video_grid_thw"] for clip in clips])  # one row per attention segment
            got = [(int(clip["video_grid_thw"][:, 0].sum()), *clip["video_grid_thw"][0, 1:].tolist()) for clip in clips]
        else:
            processed = self.image_processor(images=list(items), return_tensors="pt")
            pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
            got = [tuple(row) for row in grid.tolist()]
        if got != [layout.grid_thw for layout in layouts]:
            raise RuntimeError(f"minimax_m3_vl: the {modality} processor gave grids {got} where its sizing rule says "
                               f"{[layout.grid_thw for layout in layouts]}")
        return PreparedBatch(modality=modality, inputs={"pixel_values": pixels, "grid_thw": grid}, layouts=layouts)

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = self.to_device(batch.inputs["pixel_values"])
        features = self.model.get_image_features(pixels, batch.inputs["grid_thw"].to(self.device))
        return self.flat_rows(features.pooler_output)


def minimax_m3_vl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> MiniMaxM3VLAdapter:
    """The vision tower and projector of a MiniMax-M3 VL checkpoint; the language model is never built."""
    from transformers import AutoConfig, MiniMaxM3VLModel

    folder = Path(folder)
    image_processor, video_processor = load_processors(folder, "minimax_m3_vl")
    config = AutoConfig.from_pretrained(folder)
    model = load_vision_part(folder, MiniMaxM3VLModel, config, device, dtype)
    return MiniMaxM3VLAdapter(folder.name, model, config, image_processor, video_processor, device, dtype)


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
