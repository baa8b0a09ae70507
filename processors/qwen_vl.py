"""The qwen2_5_vl family (Qwen2.5-VL vision tower and merger), and the Qwen-grid adapter it shares.

An image of `h x w` pixels is resized to multiples of `patch_size * merge_size` (within the
processor's pixel range), cut into a `1 x gh x gw` grid of patches, and every `merge_size^2`
patches merge into one output row: `gh * gw / merge_size^2` rows. A video is a list of frames,
resized alike (with the video pixel range) and grouped `temporal_patch_size` frames per temporal
patch, the last frame repeated to fill the final group: a `t x gh x gw` grid. Two identical frames
therefore make the same temporal patch an image would (the processor repeats an image's frame).

The tower attends within each image or video (and its windows) only, so an item's rows do not
depend on the items fused beside it. `QwenVisionAdapter` and `shard_qwen_vision` serve every tower
with this grid and interface (`processors/qwen2_vl.py` uses them too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import aligned_mlp
from .base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch
from .builtin import seeded
from .family import Family
from .packed_attention import use_packed_attention
from .patch_embed import ItemPixelsForward, patches_as_matmul

#: `Qwen2VLVideoProcessor`'s class defaults (transformers/models/qwen2_vl/video_processing_qwen2_vl.py), which
#: apply where the folder's video processor settings do not say: pixels per frame, and the token budget
#: of the per-frame cap.
DEFAULT_VIDEO_MIN_PIXELS = 128 * 28 * 28
DEFAULT_VIDEO_MAX_PIXELS = 768 * 28 * 28
DEFAULT_MAX_VIDEO_TOKENS = 128000

#: The video processor settings that shape frames the way an image processor's do (the rest, such as
#: frame sampling or center cropping, `Qwen2VLVideoProcessor` does not apply to frames it is given).
FRAME_SETTINGS = ("do_resize", "size", "min_pixels", "max_pixels", "resample", "do_rescale", "rescale_factor",
                  "do_normalize", "image_mean", "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size",
                  "merge_size")


@dataclass(frozen=True)
class VideoSettings:
    """How video frames are processed: the video processor's settings (the image ones live in the image
    processor). `frame_settings` are passed to a PIL Qwen2-VL image processor that resizes and normalises
    the frames, as `Qwen2VLVideoProcessor` would (its own code needs torchvision)."""

    min_pixels: int = DEFAULT_VIDEO_MIN_PIXELS
    max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = DEFAULT_MAX_VIDEO_TOKENS
    frame_settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_processor_dict(cls, settings: dict[str, Any]) -> VideoSettings:
        """Settings from a video processor dict, read the way `Qwen2VLVideoProcessor.__init__` reads them."""
        frame_settings = {key: settings[key] for key in FRAME_SETTINGS if key in settings}
        frame_settings.setdefault("size", {"shortest_edge": DEFAULT_VIDEO_MIN_PIXELS,
                                           "longest_edge": DEFAULT_VIDEO_MAX_PIXELS})
        frames = frame_processor(frame_settings)  # resolves `size` against `min_pixels`/`max_pixels`
        return cls(min_pixels=int(frames.size.shortest_edge), max_pixels=int(frames.size.longest_edge),
                   # None (unset) means False in transformers 5.23, with a warning that the default will change
                   cap_pixels_per_frame=bool(settings.get("cap_pixels_per_frame")),
                   max_video_tokens=int(settings.get("max_video_tokens", DEFAULT_MAX_VIDEO_TOKENS)),
                   frame_settings=frame_settings)

    def max_pixels_for(self, frames: int, factor: int, temporal_patch_size: int) -> int:
        """A clip's per-frame pixel cap, as `Qwen2VLVideoProcessor.resize` computes it: with
        `cap_pixels_per_frame`, every frame gets an even share of `max_video_tokens`' worth of pixels
        (90% of them), floored at 1.05 times the minimum."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
        return max(min(self.max_pixels, total_pixels * temporal_patch_size // frames), int(self.min_pixels * 1.05))


def frame_processor(settings: dict[str, Any]) -> Any:
    """A PIL Qwen2-VL image processor with these settings."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**settings)


def video_settings_from_folder(folder: Path) -> VideoSettings:
    """The video processor settings `transformers` loads from the folder: the nested `video_processor` of
    `processor_config.json`, else `video_preprocessor_config.json`, else `preprocessor_config.json`
    (`get_video_processor_dict`, called here; it needs no torchvision)."""
    from transformers.video_processing_utils import BaseVideoProcessor

    settings, _ = BaseVideoProcessor.get_video_processor_dict(str(folder), local_files_only=True)
    return VideoSettings.from_processor_dict(settings)


class QwenVisionAdapter(ItemPixelsForward, EncoderAdapter):
    """Runs a Qwen-grid vision tower (`tower(pixels, grid_thw).pooler_output`) on images and videos."""

    def __init__(self, name: str, tower: torch.nn.Module, image_processor: Any, device: torch.device,
                 dtype: torch.dtype, video: VideoSettings | None = None, family: str = "qwen2_5_vl") -> None:
        from .fast_patches import accelerated  # imports transformers' Qwen2-VL and GLM-4V processors
        self.encoder = torch.nn.ModuleDict({"visual": tower}).to(device=device, dtype=dtype).eval()
        self.tower = self.encoder["visual"]
        self.embeds_parts = patches_as_matmul(self.tower.patch_embed)
        self.packed_attention = use_packed_attention(self.tower)
        on_cuda = torch.device(device).type == "cuda"
        self.padded_mlps = aligned_mlp.align_mlp_widths(self.tower) if on_cuda and aligned_mlp.enabled else 0
        self.image_processor = accelerated(image_processor)
        self.video = video or VideoSettings()
        self.device = device
        self.dtype = dtype
        config = tower.config
        self.merge_size = int(config.spatial_merge_size)
        self.temporal_patch_size = int(config.temporal_patch_size)
        # Qwen2.5-VL names the merger's output width `out_hidden_size`; Qwen2-VL calls it `hidden_size`.
        width = getattr(config, "out_hidden_size", None) or config.hidden_size
        self.info = ModelInfo(name=name, family=family, modalities=("image", "video"), hidden_size=int(width))
        self.patch_size = int(config.patch_size)
        tower_grid = (self.patch_size, self.merge_size, self.temporal_patch_size)
        image_grid = (int(image_processor.patch_size), int(image_processor.merge_size),
                      int(image_processor.temporal_patch_size))
        if image_grid != tower_grid:
            raise ValueError(f"image processor (patch, merge, temporal patch) {image_grid} does not match the "
                             f"vision tower's {tower_grid}")
        self.min_pixels = int(image_processor.size.shortest_edge)
        self.max_pixels = int(image_processor.size.longest_edge)
        self.frame_processor = accelerated(frame_processor(self.video.frame_settings))
        video_grid = (int(self.frame_processor.patch_size), int(self.frame_processor.merge_size),
                      int(self.frame_processor.temporal_patch_size))
        if video_grid != tower_grid:
            raise ValueError(f"video processor (patch, merge, temporal patch) {video_grid} does not match the "
                             f"vision tower's {tower_grid}")
        if not (image_processor.do_resize and self.frame_processor.do_resize):
            raise ValueError("processors with do_resize false are not supported: their row counts would not be "
                             "known before preprocessing")

    def sample_item(self) -> tuple[str, Any]:
        return "image", Image.new("RGB", (56, 56), (128, 128, 128))

    # --- layouts ---------------------------------------------------------------------------------

    def _resized(self, width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            return smart_resize(height, width, factor=self.patch_size * self.merge_size,
                                min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError as exc:
            raise ItemError(f"image of {width}x{height} pixels: {exc}") from None

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "video":
            if not isinstance(item, list) or not item or not all(isinstance(f, Image.Image) for f in item):
                raise ItemError("expected a video as a non-empty list of frames")
            resized_h, resized_w = self._resized(*item[0].size, self.video.min_pixels,
                                                 self._video_max_pixels(len(item)))
            grid_t = -(-len(item) // self.temporal_patch_size)
        else:
            if not isinstance(item, Image.Image):
                raise ItemError(f"expected an image, got {type(item).__name__}")
            resized_h, resized_w = self._resized(*item.size, self.min_pixels, self.max_pixels)
            grid_t = 1
        grid_h, grid_w = resized_h // self.patch_size, resized_w // self.patch_size
        return ItemLayout(tokens=grid_t * grid_h * grid_w // (self.merge_size**2), grid_thw=(grid_t, grid_h, grid_w))

    # --- preprocessing ---------------------------------------------------------------------------

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality == "video":
            pieces = [self._video_patches(frames) for frames in items]
            pixels = torch.cat([patches for patches, _ in pieces])
            grid = torch.tensor([grid for _, grid in pieces], dtype=torch.long)
        else:
            processed = self.image_processor(images=list(items), return_tensors="pt")
            pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
        layouts = [
            ItemLayout(tokens=int(t * h * w) // (self.merge_size**2), grid_thw=(int(t), int(h), int(w)))
            for t, h, w in grid.tolist()
        ]
        return PreparedBatch(modality=modality, layouts=layouts, inputs={"pixel_values": pixels, "grid_thw": grid})

    def _video_max_pixels(self, frames: int) -> int:
        return self.video.max_pixels_for(frames, self.patch_size * self.merge_size, self.temporal_patch_size)

    def _video_patches(self, frames: Sequence[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches of a clip in the tower's layout: `(t, gh/m, gw/m, m, m)` rows of `(C, tps, ps, ps)`."""
        first = frames[0].size
        frames = [frame if frame.size == first else frame.resize(first, Image.Resampling.BICUBIC)
                  for frame in frames]
        size = {"shortest_edge": self.video.min_pixels, "longest_edge": self._video_max_pixels(len(frames))}
        processed = self.frame_processor(images=list(frames), size=size, return_tensors="np")
        _, grid_h, grid_w = (int(v) for v in processed["image_grid_thw"][0])
        channels, tps, ps = 3, self.temporal_patch_size, self.patch_size
        # The image processor repeats each frame over the temporal axis; keep one copy per frame.
        per_frame = processed["pixel_values"].reshape(len(frames), grid_h * grid_w, channels, tps, ps, ps)[:, :, :, 0]
        if pad := -len(frames) % tps:
            per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)])
        grid_t = per_frame.shape[0] // tps
        # (t, tps, rows, C, ps, ps) -> (t, rows, C, tps, ps, ps)
        grouped = per_frame.reshape(grid_t, tps, grid_h * grid_w, channels, ps, ps).transpose(0, 2, 3, 1, 4, 5)
        patches = np.ascontiguousarray(grouped).reshape(grid_t * grid_h * grid_w, channels * tps * ps * ps)
        return torch.from_numpy(patches), (grid_t, grid_h, grid_w)

    def tower_rows(self, pixels: Any, grid: torch.Tensor, modality: str) -> torch.Tensor:
        return self.tower(pixels, grid_thw=grid).pooler_output


def load_qwen_vision(folder: Path, device: torch.device, dtype: torch.dtype, config_class: Any, tower_class: Any,
                     family: str) -> QwenVisionAdapter:
    """A Qwen-grid vision tower (`visual.*` in the checkpoint) and the folder's image and video processors,
    each resolved as `transformers` resolves it; the language model is never built."""
    from transformers import AutoImageProcessor

    from .checkpoint import load_encoder_modules

    vision_config = config_class.from_pretrained(folder).vision_config
    vision_config._attn_implementation = "sdpa"
    modules = load_encoder_modules(folder, lambda: {"visual": tower_class._from_config(vision_config)})
    # Nested `image_processor` of processor_config.json first, then preprocessor_config.json.
    processor = AutoImageProcessor.from_pretrained(folder)
    return QwenVisionAdapter(folder.name, modules["visual"], processor, device, dtype,
                             video=video_settings_from_folder(folder), family=family)


def qwen25_vl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> QwenVisionAdapter:
    """The vision tower and merger of a Qwen2.5-VL checkpoint."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return load_qwen_vision(folder, device, dtype, Qwen2_5_VLConfig, Qwen2_5_VisionTransformerPretrainedModel,
                            "qwen2_5_vl")


def tiny_qwen25_vl(device: torch.device, dtype: torch.dtype) -> QwenVisionAdapter:
    """`tiny-qwen2.5-vl`: 4 blocks, width 128, patch 14, merge 2; 56x56 to 448x448 pixels per image or frame."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1, 3],
    )
    config._attn_implementation = "sdpa"
    tower = seeded(lambda: Qwen2_5_VisionTransformerPretrainedModel._from_config(config).float())
    # Up to 448x448 pixels per image or frame: at most 256 rows each, which keeps CPU forwards short.
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    video = VideoSettings(min_pixels=56 * 56, max_pixels=448 * 448)
    return QwenVisionAdapter("tiny-qwen2.5-vl", tower, processor, device, dtype, video=video)


def shard_qwen_vision(adapter: QwenVisionAdapter, mesh: Any, mlp_colwise: Sequence[str],
                      mlp_rowwise: Sequence[str]) -> None:
    """Every block: fused `qkv` reordered then column-wise, `proj` row-wise, and the MLP as named."""
    from .sharding import check_heads, reorder_fused_qkv, split_linears

    world = mesh.size()
    for block in adapter.tower.blocks:
        local = check_heads(block.attn.num_heads, world, adapter.info.family)
        reorder_fused_qkv(block.attn.qkv, block.attn.num_heads, world)
        block.attn.num_heads = local
        split_linears(block.attn, mesh, colwise=["qkv"], rowwise=["proj"])
        split_linears(block.mlp, mesh, colwise=mlp_colwise, rowwise=mlp_rowwise)


def shard_qwen25_vl(adapter: QwenVisionAdapter, mesh: Any) -> None:
    shard_qwen_vision(adapter, mesh, mlp_colwise=["gate_proj", "up_proj"], mlp_rowwise=["down_proj"])


FAMILY = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    modalities=("image", "video"),
    row_formula="`t*h*w / merge^2`",
    grid_thw="the tower's patch grid; `t` = 1 for an image, frames / temporal patch for a video (last frame repeated)",
    load=qwen25_vl_from_folder,
    builtins={"tiny-qwen2.5-vl": tiny_qwen25_vl},
    shard=shard_qwen25_vl,
)
