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

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch
from .builtin import seeded
from .family import Family

#: Qwen2-VL's video processor defaults (pixels per frame), used when a folder has no video config.
DEFAULT_VIDEO_MIN_PIXELS = 128 * 28 * 28
DEFAULT_VIDEO_MAX_PIXELS = 768 * 28 * 28


@dataclass(frozen=True)
class VideoSettings:
    """Per-frame pixel range for videos (the image range lives in the image processor)."""

    min_pixels: int = DEFAULT_VIDEO_MIN_PIXELS
    max_pixels: int = DEFAULT_VIDEO_MAX_PIXELS


class QwenVisionAdapter(EncoderAdapter):
    """Runs a Qwen-grid vision tower (`tower(pixels, grid_thw).pooler_output`) on images and videos."""

    def __init__(self, name: str, tower: torch.nn.Module, image_processor: Any, device: torch.device,
                 dtype: torch.dtype, video: VideoSettings | None = None, family: str = "qwen2_5_vl") -> None:
        self.encoder = torch.nn.ModuleDict({"visual": tower}).to(device=device, dtype=dtype).eval()
        self.tower = self.encoder["visual"]
        self.image_processor = image_processor
        self.video = video or VideoSettings()
        self.device = device
        self.dtype = dtype
        config = tower.config
        self.merge_size = int(config.spatial_merge_size)
        self.temporal_patch_size = int(config.temporal_patch_size)
        # Qwen2.5-VL names the merger's output width `out_hidden_size`; Qwen2-VL calls it `hidden_size`.
        width = getattr(config, "out_hidden_size", None) or config.hidden_size
        self.info = ModelInfo(name=name, family=family, modalities=("image", "video"), hidden_size=int(width))
        processor_patch = int(image_processor.patch_size)
        processor_merge = int(image_processor.merge_size)
        if processor_patch != int(config.patch_size) or processor_merge != self.merge_size:
            raise ValueError(
                f"processor (patch {processor_patch}, merge {processor_merge}) does not match the vision "
                f"tower (patch {config.patch_size}, merge {self.merge_size})"
            )
        self.patch_size = processor_patch
        self.min_pixels = int(image_processor.size.shortest_edge)
        self.max_pixels = int(image_processor.size.longest_edge)

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
            resized_h, resized_w = self._resized(*item[0].size, self.video.min_pixels, self.video.max_pixels)
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

    def _video_patches(self, frames: Sequence[Image.Image]) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches of a clip in the tower's layout: `(t, gh/m, gw/m, m, m)` rows of `(C, tps, ps, ps)`."""
        first = frames[0].size
        frames = [frame if frame.size == first else frame.resize(first, Image.Resampling.BICUBIC)
                  for frame in frames]
        size = {"shortest_edge": self.video.min_pixels, "longest_edge": self.video.max_pixels}
        processed = self.image_processor(images=list(frames), size=size, return_tensors="np")
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

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = batch.inputs["pixel_values"].to(device=self.device, dtype=self.dtype, non_blocking=True)
        grid = batch.inputs["grid_thw"].to(self.device)
        rows = self.tower(pixels, grid_thw=grid).pooler_output
        return rows.to("cpu").contiguous()


def _video_settings(folder: Path) -> VideoSettings:
    path = folder / "video_preprocessor_config.json"
    if not path.is_file():
        return VideoSettings()
    config = json.loads(path.read_text())
    size = config.get("size") or {}
    return VideoSettings(
        min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or DEFAULT_VIDEO_MIN_PIXELS),
        max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or DEFAULT_VIDEO_MAX_PIXELS),
    )


def qwen25_vl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> QwenVisionAdapter:
    """The vision tower and merger of a Qwen2.5-VL checkpoint; the language model is never built."""
    from transformers import AutoImageProcessor, Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    from .checkpoint import load_encoder_modules

    vision_config = Qwen2_5_VLConfig.from_pretrained(folder).vision_config
    vision_config._attn_implementation = "sdpa"
    modules = load_encoder_modules(
        folder, lambda: {"visual": Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)})
    processor = AutoImageProcessor.from_pretrained(folder)
    return QwenVisionAdapter(folder.name, modules["visual"], processor, device, dtype, video=_video_settings(folder))


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
