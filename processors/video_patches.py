"""Video patching exactly as `transformers`' Qwen-style video processors do it, without torchvision.

The video processors of Qwen3-VL and GLM-4V (`video_processing_qwen3_vl.py`, `video_processing_glm4v.py`)
are torchvision-only, and torchvision is not installed here. Their work is a few tensor operations,
repeated here with torch alone, while every setting comes from the `transformers` video processor
object itself (loading and instantiating it needs no torchvision, only running it does):

1. the frames become a `(T, C, H, W)` uint8 tensor, as `make_batched_videos` + `_prepare_input_videos`;
2. the family sizes the whole clip (`resized_size`: its own `smart_resize`, over all frames at once);
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

import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .base import ItemError

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

    def __init__(self, processor: Any, resized_size: ResizedSize) -> None:
        self.processor = processor
        self.resized_size = resized_size
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


def load_video_processor(processor_class: type, folder: Any) -> Any:
    """The folder's video processor settings, resolved as `transformers` resolves them.

    `from_pretrained` reads the nested `video_processor` of `processor_config.json`, else
    `video_preprocessor_config.json`, else `preprocessor_config.json` (`get_video_processor_dict`),
    and fills the rest from the class defaults. Only its settings are used here.
    """
    return processor_class.from_pretrained(str(folder))
