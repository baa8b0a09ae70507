"""MiniMax-M3 VL's processor: its own torchvision-backed image and video processors, with the grids their sizing
rule gives (`smart_resize` to whole merged patches within the processor's pixel range; a video's frames in
temporal patches), each patch's time at its first frame (`first_frame_timestamps`), as its prompt names it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from processors.base import ItemError, ItemLayout, PreparedBatch
from processors.torchvision_processors import check_clip, grid_batch
from processors.video_clip import clip_timestamps, first_frame_timestamps
from processors.vision_part import ImageProcessorBase, as_images


def _resized(height: int, width: int, *, do_resize: bool, factor: int, min_pixels: int,
             max_pixels: int) -> tuple[int, int]:
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import smart_resize

    if do_resize:
        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    if height % factor or width % factor:
        raise ValueError(f"not whole {factor}-pixel merged patches and the processor does not resize")
    return height, width


class MiniMaxM3VLProcessor(ImageProcessorBase):
    """Images and videos through MiniMax-M3 VL's own processors."""

    modalities = ("image", "video")

    def __init__(self, image_processor: Any, video_processor: Any) -> None:
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.patch = int(image_processor.patch_size)
        self.merge_area = int(image_processor.merge_size) ** 2
        self.temporal = int(image_processor.temporal_patch_size)
        factor = self.patch * int(image_processor.merge_size)
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
        # A clip's grid has one row per attention segment: its frames are their sum.
        return grid_batch("minimax_m3_vl", modality, items, layouts, self.image_processor, self.video_processor,
                          lambda grid: (int(grid[:, 0].sum()), *grid[0, 1:].tolist()))
