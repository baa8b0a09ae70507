"""Qwen-style patch grids: images and videos cut into `patch x patch` patches on a `t x h x w` grid.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and Qwen3.5), GLM-4V, GLM-5-Next, Dots3-Note and the Omni thinkers' vision
towers take an image or a video as patches on a `t x h x w` grid (`t` counts groups of `temporal_patch_size`
frames; an image is one group) and merge every `merge x merge` patches into one output row: `t * h * w / merge^2`
rows per item. Images go through the folder's image processor (as `AutoImageProcessor` resolves it, with the
faster, bit-identical patchify of `fast_patches.py` where it is a stock Qwen2-VL or GLM-4V one, of either
backend) in one call for the batch; videos through `VideoPatcher` (`video_patches.py`) or a family's
torchvision-backed `ClipVideo`. What differs per family is how the image size is chosen (`image_size`): the
sizing rules of Qwen2-VL and GLM-4V are here, each a module-level function bound to the processor's settings
with `functools.partial`, so that the processor pickles into the preprocessing workers.

With `video_timestamps`, a video's layout also holds the seconds of each temporal patch, which Qwen3-VL's prompt
names (`video_clip.py`); GLM-4V's prefill side does not read them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from processors.base import ItemError, ItemLayout, PreparedBatch, Processor
from processors.video_clip import clip_timestamps

#: (height, width) of an image -> the (height, width) the image processor resizes it to.
ImageSize = Callable[[int, int], tuple[int, int]]


class GridProcessor(Processor):
    """Images through the folder's image processor, videos through a video patcher, on one patch grid."""

    # Image and video processors, table lookups and tensor ops only: nothing kept or changed between calls.
    concurrent_calls = True

    def __init__(self, image_processor: Any, video: Any, image_size: ImageSize, video_timestamps: bool = False,
                 modalities: tuple[str, ...] = ("image", "video")) -> None:
        # Imported here: it imports transformers' Qwen2-VL and GLM-4V processors.
        from processors.fast_patches import accelerated

        self.image_processor = accelerated(image_processor)
        self.video = video
        self.image_size = image_size
        self.video_timestamps = video_timestamps
        self.modalities = modalities
        self.patch_size = int(image_processor.patch_size)
        self.merge_size = int(image_processor.merge_size)
        self.temporal_patch_size = int(image_processor.temporal_patch_size)

    def grid_settings(self) -> dict[str, tuple[int, int, int]]:
        """(patch, merge, temporal patch) of the image processor and of the video patcher, for the loader's check
        against the tower."""
        return {what: (int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size))
                for what, processor in (("image", self.image_processor), ("video", self.video))}

    def sample_item(self) -> tuple[str, Any]:
        side = 2 * self.patch_size * self.merge_size
        return "image", Image.new("RGB", (side, side), (128, 128, 128))

    # --- layouts ---------------------------------------------------------------------------------

    def rows(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w) // (self.merge_size**2)

    def _video_layout(self, frames: Any, grid: Sequence[int]) -> ItemLayout:
        timestamps = clip_timestamps(frames, self.video.temporal_patch_size) if self.video_timestamps else None
        return ItemLayout(tokens=self.rows(grid), grid_thw=tuple(int(v) for v in grid), video_timestamps=timestamps)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "video":
            return self._video_layout(item, self.video.layout(item).grid_thw)
        if not isinstance(item, Image.Image):
            raise ItemError(f"expected an image, got {type(item).__name__}")
        width, height = item.size
        try:
            height, width = self.image_size(height, width)
        except ValueError as exc:
            raise ItemError(f"image of {width}x{height} pixels: {exc}") from None
        grid = (1, height // self.patch_size, width // self.patch_size)
        return ItemLayout(tokens=self.rows(grid), grid_thw=grid)

    # --- preprocessing ---------------------------------------------------------------------------

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality == "video":
            pieces = [self.video.patches(frames) for frames in items]
            pixels = torch.cat([patches for patches, _ in pieces])
            grid = torch.tensor([layout.grid_thw for _, layout in pieces], dtype=torch.long)
            layouts = [self._video_layout(frames, clip.grid_thw) for frames, (_, clip) in zip(items, pieces)]
        else:
            for item in items:  # the processor would fail the whole batch on one bad item
                self.item_layout(modality, item)
            processed = self.image_processor(images=list(items), return_tensors="pt")
            pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
            layouts = [ItemLayout(tokens=self.rows(row), grid_thw=tuple(int(v) for v in row))
                       for row in grid.tolist()]
        return PreparedBatch(modality=modality, layouts=layouts, inputs={"pixel_values": pixels, "grid_thw": grid})


# --- image sizing rules --------------------------------------------------------------------------

def unchanged_size(height: int, width: int) -> tuple[int, int]:
    """The image size of a processor that does not resize."""
    return height, width


def resize_rule(size_of: Callable[..., tuple[int, int]], image_processor: Any, **settings: Any) -> ImageSize:
    """`size_of(height, width, **settings)` as an `ImageSize` (a partial of a module-level function pickles)."""
    if not image_processor.do_resize:
        return unchanged_size
    return functools.partial(size_of, **settings)


def qwen_image_size(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's `smart_resize` of one image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def qwen_image_size_of(image_processor: Any) -> ImageSize:
    """How the Qwen2-VL image processor (PIL or torchvision backend) sizes an image."""
    size = image_processor.size
    return resize_rule(qwen_image_size, image_processor,
                       factor=int(image_processor.patch_size) * int(image_processor.merge_size),
                       min_pixels=size.shortest_edge, max_pixels=size.longest_edge)


def glm4v_image_size(height: int, width: int, *, temporal: int, factor: int, min_pixels: int,
                     max_pixels: int) -> tuple[int, int]:
    """GLM-4V's `smart_resize` of one image, counted as `temporal` identical frames."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    return smart_resize(num_frames=temporal, height=height, width=width, temporal_factor=temporal, factor=factor,
                        min_pixels=min_pixels, max_pixels=max_pixels)


def glm4v_image_size_of(image_processor: Any) -> ImageSize:
    """How `Glm4vImageProcessorPil.resize` sizes an image (as `temporal_patch_size` identical frames)."""
    size = image_processor.size
    return resize_rule(glm4v_image_size, image_processor, temporal=int(image_processor.temporal_patch_size),
                       factor=int(image_processor.patch_size) * int(image_processor.merge_size),
                       min_pixels=size.shortest_edge, max_pixels=size.longest_edge)
