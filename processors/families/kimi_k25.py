"""Kimi K2.5's processor: its own torchvision-backed image and video processors (`torchvision_processors.py`),
with the grids their sizing rule gives (`navit_resize` into the processor's budget of patches, then padding to
whole merged patches); a video is cut into chunks of `temporal_patch_size` frames, one grid row each, and every
`merge x merge` patches of a chunk pool into one row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from processors.base import ItemError, ItemLayout, PreparedBatch
from processors.torchvision_processors import check_clip, grid_batch
from processors.vision_part import ImageProcessorBase, as_images


def _patch_grid(processor: Any, height: int, width: int) -> tuple[int, int]:
    """The `(h, w)` patch grid the processor makes of a frame: `navit_resize` into its budget, then padding."""
    from transformers.models.kimi_k25.image_processing_kimi_k25 import navit_resize

    patch, merge = int(processor.patch_size), int(processor.merge_size)
    if processor.do_resize:
        _, (height, width) = navit_resize(height, width, patch_size=patch, merge_kernel_size=merge,
                                          max_patches=int(processor.max_patches),
                                          max_size_per_side=int(processor.size.max_height))
    elif height % (patch * merge) or width % (patch * merge):
        raise ItemError(f"a {width}x{height} image is not whole {patch * merge}-pixel merged patches and the "
                        "processor does not resize")
    return height // patch, width // patch


class KimiK25Processor(ImageProcessorBase):
    """Images and video chunks through Kimi K2.5's own processors."""

    modalities = ("image", "video")

    def __init__(self, image_processor: Any, video_processor: Any) -> None:
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.merge_area = int(image_processor.merge_size) ** 2
        self.chunk_frames = int(video_processor.temporal_patch_size)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "video":
            frames = check_clip(item)
            width, height = frames[0].size
            grid = (-(-len(frames) // self.chunk_frames), *_patch_grid(self.video_processor, height, width))
        else:
            (image,) = as_images([item])
            width, height = image.size
            grid = (1, *_patch_grid(self.image_processor, height, width))
        return ItemLayout(tokens=grid[0] * grid[1] * grid[2] // self.merge_area, grid_thw=grid)

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        layouts = [self.item_layout(modality, item) for item in items]  # one bad item must not fail the call
        return grid_batch("kimi_k25", modality, items, layouts, self.image_processor, self.video_processor,
                          lambda grid: (len(grid), *grid[0, 1:].tolist()))  # one grid row per chunk
