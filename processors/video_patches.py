"""Video patching exactly as `transformers`' Qwen-style video processors do it, with or without torchvision.

The video processors of Qwen2-VL, Qwen3-VL and GLM-4V (`video_processing_qwen2_vl.py`,
`video_processing_qwen3_vl.py`, `video_processing_glm4v.py`) are torchvision-only: where torchvision is
installed they are what `AutoProcessor` runs, and where it is not, `transformers` has no video path for
these models at all. `VideoPatcher` is the one video path of every family with this grid (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V, GLM-5-Next, the Omni thinkers, Dots3-Note) in both
environments: their work is a few tensor operations, repeated here with torch alone, while every
setting comes from the `transformers` video processor object itself, loaded from the folder as
`AutoVideoProcessor` would (`load_video_processor`; instantiating it needs no torchvision, only
running it does, except Qwen2-VL's whose module imports torchvision: a settings-only twin stands in).
Its values equal those processors' own, value for value, with torchvision installed and hidden
(`tests/processors/test_video_parity.py`):

1. the frames become a `(T, C, H, W)` uint8 tensor, as `make_batched_videos` + `_prepare_input_videos`;
2. the clip's frame size comes from the processor class's own `resize` logic (`CLIP_SIZING`: its
   `smart_resize`, per frame for Qwen2-VL, over the whole clip for Qwen3-VL and GLM-4V);
3. every frame is resized with `torch.nn.functional.interpolate(uint8, antialias=True)`, which is the
   call torchvision's `resize` makes for uint8 images on the CPU (bicubic always; bilinear on AVX2,
   AVX512 and ARM CPUs, else through float32 and rounding, as torchvision does);
4. rescale and normalize fused in float32 (`TorchvisionBackend.rescale_and_normalize`);
5. the clip is padded to a multiple of `temporal_patch_size` by repeating its last frame and cut into
   `(t, h/m, w/m, m, m)` rows of `(C, temporal_patch_size, patch, patch)` values (`patchify`).

The frames of an item are used as given: they are the sampled video (the server's video-file decoder
samples at `--video-fps`, as the processor's `fps` would), so the processor's own frame sampling is
not applied again; the prefill side's equivalent call is `processor(videos=frames,
do_sample_frames=False)` (or with the frames' true `video_metadata`, which samples every frame).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from processors.base import ItemError

#: PIL resample codes -> `interpolate` modes torchvision uses for them on uint8 images.
_RESAMPLE_MODES = {Image.Resampling.BICUBIC: "bicubic", Image.Resampling.BILINEAR: "bilinear"}

#: (num_frames, height, width) -> the resized (height, width) of every frame of the clip.
ResizedSize = Callable[[int, int, int], tuple[int, int]]


@dataclass(frozen=True)
class ClipLayout:
    """How a clip is cut: its frame count, the size every frame is resized to, and its grid."""

    num_frames: int
    height: int
    width: int
    grid_thw: tuple[int, int, int]


class VideoPatcher:
    """Turns a clip (a list of PIL frames) into the tower's patches, with a video processor's settings."""

    def __init__(self, processor: Any) -> None:
        kind = type(processor).__name__
        if kind not in CLIP_SIZING:
            raise ValueError(f"video processor {kind} is not supported without torchvision "
                             f"(supported: {', '.join(sorted(CLIP_SIZING))})")
        self.processor = processor
        self.resized_size = CLIP_SIZING[kind](processor)
        self.patch_size = int(processor.patch_size)
        self.merge_size = int(processor.merge_size)
        self.temporal_patch_size = int(processor.temporal_patch_size)
        resample = Image.Resampling(int(processor.resample if processor.resample is not None else 2))
        if resample not in _RESAMPLE_MODES:
            raise ValueError(f"video resample {resample.name} is not supported without torchvision "
                             f"(supported: {', '.join(m.name for m in _RESAMPLE_MODES)})")
        self.mode = _RESAMPLE_MODES[resample]
        self.do_resize = bool(processor.do_resize)
        self.do_rescale, self.do_normalize = bool(processor.do_rescale), bool(processor.do_normalize)
        self.rescale_factor = float(processor.rescale_factor)
        mean, std = processor.image_mean, processor.image_std
        if self.do_rescale and self.do_normalize:  # fused, exactly as `_fuse_mean_std_and_rescale_factor`
            self.mean = torch.tensor(mean) * (1.0 / self.rescale_factor)
            self.std = torch.tensor(std) * (1.0 / self.rescale_factor)
        else:
            self.mean, self.std = torch.as_tensor(mean, dtype=torch.float32), torch.as_tensor(std, dtype=torch.float32)

    # --- layout (cheap: sizes only) ------------------------------------------------------------

    def layout(self, frames: Sequence[Any]) -> ClipLayout:
        if not isinstance(frames, list) or not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise ItemError("expected a video as a non-empty list of frames")
        width, height = frames[0].size
        if self.do_resize:
            try:
                height, width = self.resized_size(len(frames), height, width)
            except ValueError as exc:
                raise ItemError(f"video of {len(frames)} frames of {width}x{height} pixels: {exc}") from None
        factor = self.patch_size * self.merge_size
        if height % factor or width % factor:
            raise ItemError(f"video frames of {width}x{height} pixels are not multiples of {factor} "
                            "and the video processor does not resize")
        grid_t = -(-len(frames) // self.temporal_patch_size)
        return ClipLayout(len(frames), height, width,
                          (grid_t, height // self.patch_size, width // self.patch_size))

    # --- pixels --------------------------------------------------------------------------------

    def patches(self, frames: Sequence[Image.Image]) -> tuple[torch.Tensor, ClipLayout]:
        """`[t * h * w, C * tps * ps * ps]` float32 patches of one clip, and its layout."""
        layout = self.layout(frames)
        video = self._resized(self._uint8_frames(frames), layout.height, layout.width)
        video = self._rescaled_normalized(video)
        return self._patchify(video, layout), layout

    @staticmethod
    def _uint8_frames(frames: Sequence[Image.Image]) -> torch.Tensor:
        first = frames[0].size
        rgb = [frame if frame.mode == "RGB" else frame.convert("RGB") for frame in frames]
        # transformers stacks the frames into one array, so they must share a size; ours may not.
        same_size = [frame if frame.size == first else frame.resize(first, Image.Resampling.BICUBIC) for frame in rgb]
        return torch.from_numpy(np.stack([np.asarray(frame) for frame in same_size])).permute(0, 3, 1, 2).contiguous()

    def _resized(self, video: torch.Tensor, height: int, width: int) -> torch.Tensor:
        if tuple(video.shape[-2:]) == (height, width):
            return video  # torchvision returns the image untouched when the size does not change
        if self.mode == "bicubic" or _native_uint8_bilinear():
            return F.interpolate(video, size=[height, width], mode=self.mode, align_corners=False, antialias=True)
        resized = F.interpolate(video.float(), size=[height, width], mode=self.mode, align_corners=False,
                                antialias=True)
        return resized.round_().to(torch.uint8)

    def _rescaled_normalized(self, video: torch.Tensor) -> torch.Tensor:
        if self.do_normalize:
            return (video.to(torch.float32) - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)
        if self.do_rescale:
            return video * self.rescale_factor
        return video.to(torch.float32)

    def _patchify(self, video: torch.Tensor, layout: ClipLayout) -> torch.Tensor:
        tps, ps, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -video.shape[0] % tps:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        grid_t, grid_h, grid_w = layout.grid_thw
        channels = video.shape[1]
        patches = video.view(grid_t, tps, channels, grid_h // m, m, ps, grid_w // m, m, ps)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(grid_t * grid_h * grid_w, channels * tps * ps * ps)


def _native_uint8_bilinear() -> bool:
    """Whether torchvision resizes uint8 bilinear natively here (else through float32 and rounding)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")


# --- how each video processor sizes a clip (its `resize`), by class name -------------------------

# Each sizing is a module-level function bound to the processor's settings with `functools.partial`, so
# that an adapter's preprocessing copy pickles (preprocessing workers receive it).

def _sizing_settings(processor: Any) -> dict[str, Any]:
    size = _checked_size(processor)
    cap = int(processor.max_video_tokens) if getattr(processor, "cap_pixels_per_frame", False) else 0
    return {"min_pixels": int(size.shortest_edge), "max_pixels": int(size.longest_edge), "factor": _factor(processor),
            "temporal": int(processor.temporal_patch_size), "max_video_tokens": cap}


def _qwen2_vl_resized(num_frames: int, height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int,
                      temporal: int, max_video_tokens: int) -> tuple[int, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    if max_video_tokens:
        total_pixels = int(max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * temporal // num_frames), int(min_pixels * 1.05))
    return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def _qwen2_vl_sizing(processor: Any) -> ResizedSize:
    """`Qwen2VLVideoProcessor.resize`: Qwen2-VL's per-frame `smart_resize`, with its optional total-pixel cap."""
    return functools.partial(_qwen2_vl_resized, **_sizing_settings(processor))


def _qwen3_vl_resized(num_frames: int, height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int,
                      temporal: int, max_video_tokens: int) -> tuple[int, int]:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    if max_video_tokens:
        frame_cap = max_video_tokens * factor * factor
        per_frame = max(min(frame_cap, max_pixels // num_frames), int(min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return smart_resize(num_frames=num_frames, height=height, width=width, temporal_factor=temporal,
                        factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def _qwen3_vl_sizing(processor: Any) -> ResizedSize:
    """`Qwen3VLVideoProcessor.resize`: one `smart_resize` over the whole clip, with its optional per-frame cap."""
    return functools.partial(_qwen3_vl_resized, **_sizing_settings(processor))


def _glm4v_resized(num_frames: int, height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int,
                   temporal: int, max_video_tokens: int) -> tuple[int, int]:
    from transformers.models.glm4v.video_processing_glm4v import smart_resize

    return smart_resize(num_frames=num_frames, height=height, width=width, temporal_factor=temporal, factor=factor,
                        min_pixels=min_pixels, max_pixels=max_pixels)


def _glm4v_sizing(processor: Any) -> ResizedSize:
    """`Glm4vVideoProcessor.resize`: one `smart_resize` over the whole clip."""
    return functools.partial(_glm4v_resized, **_sizing_settings(processor))


def _checked_size(processor: Any) -> Any:
    size = processor.size
    if not size.shortest_edge or not size.longest_edge:
        raise ValueError(f"the video processor's `size` needs 'shortest_edge' and 'longest_edge', got {size}")
    return size


def _factor(processor: Any) -> int:
    return int(processor.patch_size) * int(processor.merge_size)


#: Video processor class name -> how it sizes a clip. Names match `transformers`' classes.
CLIP_SIZING: dict[str, Callable[[Any], ResizedSize]] = {
    "Qwen2VLVideoProcessor": _qwen2_vl_sizing,
    "Qwen3VLVideoProcessor": _qwen3_vl_sizing,
    "Glm4vVideoProcessor": _glm4v_sizing,
}


# --- which video processor a folder gets, and its settings ------------------------------------

def load_video_processor(folder: Any, default: str) -> Any:
    """The folder's video processor (settings only), chosen and configured as `AutoVideoProcessor` does.

    Settings: the nested `video_processor` of `processor_config.json`, else
    `video_preprocessor_config.json`, else `preprocessor_config.json` (`get_video_processor_dict`).
    Class: that dict's `video_processor_type`; else its `image_processor_type` with "ImageProcessor"
    read as "VideoProcessor" when `transformers` has such a class (an image-only Qwen folder thus
    gets `Qwen2VLVideoProcessor`, whatever the model); else `config.json`'s `video_processor_type`;
    else the model type's own (`default`). Remote code (`auto_map`) is never run.
    """
    import json
    from pathlib import Path

    import transformers
    from transformers.video_processing_utils import BaseVideoProcessor

    settings, _ = BaseVideoProcessor.get_video_processor_dict(str(folder))
    name = settings.get("video_processor_type")
    if name is None and settings.get("image_processor_type"):
        inferred = str(settings["image_processor_type"]).replace("ImageProcessor", "VideoProcessor")
        if hasattr(transformers, inferred):
            name = inferred
    if name is None:
        config = Path(folder) / "config.json"
        name = (json.loads(config.read_text()).get("video_processor_type") if config.is_file() else None) or default
    return _settings_class(name).from_pretrained(str(folder))


def _settings_class(name: str) -> type:
    if name == "Qwen2VLVideoProcessor":
        return qwen2_vl_video_settings_class()
    if name == "Qwen3VLVideoProcessor":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor
    if name == "Glm4vVideoProcessor":
        from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

        return Glm4vVideoProcessor
    raise ValueError(f"video processor {name} is not supported without torchvision "
                     f"(supported: {', '.join(sorted(CLIP_SIZING))})")


def qwen2_vl_video_settings_class() -> type:
    """`Qwen2VLVideoProcessor`'s settings: its class defaults and `min_pixels`/`max_pixels` handling.

    Its module imports torchvision at the top, so the class cannot be imported here; this twin
    (same name, same defaults as in transformers 5.23, checked against the real class by
    `tests/models/test_qwen3_vl.py` through `tests/data/processor_reference.json`) only holds settings.
    """
    global _QWEN2_VL_SETTINGS
    if _QWEN2_VL_SETTINGS is None:
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
        from transformers.processing_utils import VideosKwargs
        from transformers.video_processing_utils import BaseVideoProcessor

        class Qwen2VLVideoKwargs(VideosKwargs, total=False):
            min_pixels: int
            max_pixels: int
            patch_size: int
            temporal_patch_size: int
            merge_size: int
            min_frames: int
            max_frames: int
            cap_pixels_per_frame: bool
            max_video_tokens: int

        class Qwen2VLVideoProcessor(BaseVideoProcessor):
            resample = PILImageResampling.BICUBIC
            size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
            image_mean = OPENAI_CLIP_MEAN
            image_std = OPENAI_CLIP_STD
            do_resize = True
            do_rescale = True
            do_normalize = True
            do_convert_rgb = True
            patch_size = 14
            temporal_patch_size = 2
            merge_size = 2
            min_frames = 4
            max_frames = 768
            do_sample_frames = False
            cap_pixels_per_frame = None
            max_video_tokens = 128000
            valid_kwargs = Qwen2VLVideoKwargs
            model_input_names = ["pixel_values_videos", "video_grid_thw"]

            def __init__(self, **kwargs: Any) -> None:
                size = kwargs.pop("size", None)
                size = dict(self.size) if size is None else size
                if (min_pixels := kwargs.pop("min_pixels", None)) is not None:
                    size["shortest_edge"] = min_pixels
                    size.pop("min_pixels", None)
                if (max_pixels := kwargs.pop("max_pixels", None)) is not None:
                    size["longest_edge"] = max_pixels
                    size.pop("max_pixels", None)
                super().__init__(size=size, **kwargs)

        # Pickled by reference under this module's name (resolved by `__getattr__` below), so an adapter that
        # holds these settings reaches preprocessing workers.
        Qwen2VLVideoProcessor.__module__ = __name__
        Qwen2VLVideoProcessor.__qualname__ = _QWEN2_VL_SETTINGS_NAME
        _QWEN2_VL_SETTINGS = Qwen2VLVideoProcessor
    return _QWEN2_VL_SETTINGS


_QWEN2_VL_SETTINGS: type | None = None
_QWEN2_VL_SETTINGS_NAME = "Qwen2VLVideoSettings"


def __getattr__(name: str) -> Any:
    """The settings twin by its pickled name, built on first use (importing this module stays cheap)."""
    if name == _QWEN2_VL_SETTINGS_NAME:
        return qwen2_vl_video_settings_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
