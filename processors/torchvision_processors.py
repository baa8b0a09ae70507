"""A family's own torchvision-backed `transformers` image and video processors, as the families that need them use them.

Kimi K2.5's and MiniMax-M3's image processors, and the video processors of Kimi K2.5, GLM-5-Next and
MiniMax-M3, exist in `transformers` 5.23 only with the torchvision backend. Their families run them as they
are (no re-implementation): `load_processors` builds them from the folder as `AutoImageProcessor` and
`AutoVideoProcessor` do, and refuses, naming torchvision, where it is missing. A video item is a list of
frames (the server decodes a file at `--video-fps` into one): `clip_tensor` stacks them the way
`transformers` takes a video (frames of another size than the first are resized to it first, as
`video_patches.py` does), and `process_clip` runs the video processor on that one clip with
`do_sample_frames=False`: the frames are the sampled video, the prefill side's equivalent call is
`processor(videos=frames, do_sample_frames=False)`.

`ClipVideo` gives `GridVisionAdapter` (`towers/grid_vision.py`) what it asks of a video: a cheap
`layout` from the processor's own sizing rule, and the patches from the processor itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from processors.base import CheckpointError, ItemError, ItemLayout, PreparedBatch

#: (frames, height, width) of a clip -> its `(t, h, w)` patch grid, from the video processor's own sizing rule.
ClipGrid = Callable[[int, int, int], tuple[int, int, int]]


def load_processors(folder: Path, family: str) -> tuple[Any, Any]:
    """The folder's image and video processors, as `AutoImageProcessor` / `AutoVideoProcessor` build them."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise CheckpointError(f"{folder}: {family}'s transformers processors need torchvision "
                              "(pip install torchvision, the build matching your torch)")
    from transformers import AutoImageProcessor, AutoVideoProcessor

    try:
        return AutoImageProcessor.from_pretrained(folder), AutoVideoProcessor.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {family}'s processors do not load: {exc}") from None


def check_clip(frames: Any) -> list[Image.Image]:
    """The item as a list of PIL frames, or an `ItemError`."""
    if not isinstance(frames, list) or not frames or not all(isinstance(f, Image.Image) for f in frames):
        raise ItemError("expected a video as a non-empty list of frames")
    return frames


def clip_tensor(frames: Sequence[Image.Image]) -> torch.Tensor:
    """`(T, C, H, W)` uint8 RGB: the frames as `transformers` takes one video (it stacks them, so they share a
    size: frames of another size than the first are resized to it, bicubic)."""
    first = frames[0].size
    rgb = [frame if frame.mode == "RGB" else frame.convert("RGB") for frame in frames]
    same = [frame if frame.size == first else frame.resize(first, Image.Resampling.BICUBIC) for frame in rgb]
    return torch.from_numpy(np.stack([np.asarray(frame) for frame in same])).permute(0, 3, 1, 2).contiguous()


def process_clip(video_processor: Any, frames: Sequence[Image.Image]) -> Any:
    """The video processor's output (`pixel_values_videos`, `video_grid_thw`, ...) for one clip, frames as given."""
    return video_processor(videos=[clip_tensor(frames)], do_sample_frames=False, return_tensors="pt")


@dataclass(frozen=True)
class ClipLayout:
    """A clip's frame count and patch grid."""

    num_frames: int
    grid_thw: tuple[int, int, int]


class ClipVideo:
    """A video processor for `GridVisionAdapter`: `layout` from its sizing rule, `patches` from the processor."""

    def __init__(self, video_processor: Any, clip_grid: ClipGrid) -> None:
        self.processor = video_processor
        self.clip_grid = clip_grid
        self.patch_size = int(video_processor.patch_size)
        self.merge_size = int(video_processor.merge_size)
        self.temporal_patch_size = int(video_processor.temporal_patch_size)

    def layout(self, frames: Any) -> ClipLayout:
        frames = check_clip(frames)
        width, height = frames[0].size
        try:
            grid = self.clip_grid(len(frames), height, width)
        except ValueError as exc:
            raise ItemError(f"video of {len(frames)} frames of {width}x{height} pixels: {exc}") from None
        return ClipLayout(len(frames), tuple(int(v) for v in grid))

    def patches(self, frames: Sequence[Image.Image]) -> tuple[torch.Tensor, ClipLayout]:
        """The clip's patch rows and its layout, checked against the grid the processor reports."""
        layout = self.layout(frames)
        processed = process_clip(self.processor, frames)
        grid = tuple(int(v) for v in processed["video_grid_thw"].reshape(-1).tolist())
        if grid != layout.grid_thw:
            raise RuntimeError(f"the video processor gave a {grid} grid where its sizing rule says {layout.grid_thw}")
        return processed["pixel_values_videos"], layout


def grid_batch(family: str, modality: str, items: Sequence[Any], layouts: list[ItemLayout], image_processor: Any,
               video_processor: Any, clip_grid: Callable[[Any], tuple[int, ...]]) -> PreparedBatch:
    """One processor call for a batch of a grid family's images (or videos, each clip processed on its own, its
    grid read by `clip_grid`), checked against the layouts its sizing rule gave: `pixel_values` and `grid_thw`."""
    if modality == "video":
        clips = [process_clip(video_processor, frames) for frames in items]
        pixels = torch.cat([clip["pixel_values_videos"] for clip in clips])
        grid = torch.cat([clip["video_grid_thw"] for clip in clips])
        got = [clip_grid(clip["video_grid_thw"]) for clip in clips]
    else:
        processed = image_processor(images=list(items), return_tensors="pt")
        pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
        got = [tuple(row) for row in grid.tolist()]
    if got != [layout.grid_thw for layout in layouts]:
        raise RuntimeError(f"{family}: the {modality} processor gave grids {got} where its sizing rule says "
                           f"{[layout.grid_thw for layout in layouts]}")
    return PreparedBatch(modality=modality, inputs={"pixel_values": pixels, "grid_thw": grid}, layouts=layouts)

