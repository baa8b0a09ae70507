"""GLM-5-Next's sizing rules: an image resized into a budget of rows and padded onto a canvas of whole merged
patches (`Glm5NextImageProcessor.resize`), a clip sized over all its frames at once (`Glm5NextVideoProcessor`).
Both processors are `transformers`' own, torchvision-backed (`torchvision_processors.py`); the rules here give
the same grids cheaply, without touching pixels.
"""

from __future__ import annotations

import functools
from typing import Any

from processors.grid import GridProcessor, ImageSize, unchanged_size
from processors.torchvision_processors import ClipVideo


def _canvas(height: int, width: int, *, frames: int, temporal: int, factor: int, min_tokens: int,
            max_tokens: int) -> tuple[int, int]:
    from transformers.models.glm5_next.image_processing_pil_glm5_next import smart_resize

    return smart_resize(num_frames=frames, height=height, width=width, temporal_factor=temporal, factor=factor,
                        min_pixels=min_tokens, max_pixels=max_tokens)


def _factor(processor: Any) -> int:
    # The torchvision backends size by whole patches of `patch_expand_factor` merged patches; the PIL one by merged
    # patches (the two agree at the published `patch_expand_factor` of 1).
    expand = 1 if type(processor).__name__.endswith("Pil") else int(getattr(processor, "patch_expand_factor", 1))
    return int(processor.patch_size) * int(processor.merge_size) * expand


def image_size_of(image_processor: Any) -> ImageSize:
    """The canvas `Glm5NextImageProcessor.resize` puts an image on (the image resized into it, then padded)."""
    if not image_processor.do_resize:
        return unchanged_size
    temporal = int(image_processor.temporal_patch_size)
    return functools.partial(_canvas, frames=temporal, temporal=temporal, factor=_factor(image_processor),
                             min_tokens=int(image_processor.min_image_tokens),
                             max_tokens=int(image_processor.max_image_tokens))


def _clip_grid(frames: int, height: int, width: int, *, patch: int, temporal: int, canvas: Any) -> tuple[int, int, int]:
    if canvas is not None:
        height, width = canvas(height, width, frames=frames)
    return -(-frames // temporal), height // patch, width // patch


def clip_grid_of(video_processor: Any) -> Any:
    """`Glm5NextVideoProcessor`'s grid for a clip: one canvas over the whole clip's frames."""
    temporal = int(video_processor.temporal_patch_size)
    canvas = None
    if video_processor.do_resize:
        canvas = functools.partial(_canvas, temporal=temporal, factor=_factor(video_processor),
                                   min_tokens=int(video_processor.min_image_tokens),
                                   max_tokens=int(video_processor.max_image_tokens))
    return functools.partial(_clip_grid, patch=int(video_processor.patch_size), temporal=temporal, canvas=canvas)


def glm5_next_processor(image_processor: Any, video_processor: Any) -> GridProcessor:
    """GLM-5-Next's images and videos on its patch grid, through its own processors."""
    video = ClipVideo(video_processor, clip_grid_of(video_processor))
    return GridProcessor(image_processor, video, image_size_of(image_processor))
