"""The adapter shared by vision towers fed Qwen-style patches and a `(t, h, w)` grid per item.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and Qwen3.5), GLM-4V and the Omni thinkers' vision towers
(`omni_thinker.py`) cut an image or a video into `patch x patch` patches on a `t x h x w` grid (`t` counts
groups of `temporal_patch_size` frames; an image is one group) and merge every `merge x merge` patches into one
output row: `t * h * w / merge^2` rows per item. Images go
through the folder's image processor (as `AutoImageProcessor` resolves it) in one call for the batch;
videos through `VideoPatcher` (the folder's video processor settings). What differs per family is how the image
size is chosen (`image_size`) and how the tower is run (`run_tower`, which returns the rows); the Qwen2-VL image
processor's sizing and the Qwen towers' run functions, which several families use, are here.

Rows never depend on the items fused beside them: these towers attend within each item only (or within
windows of it, Qwen2.5-Omni's), and their position embeddings come from each item's own grid.

With `video_timestamps`, a video's layout also holds the seconds of each temporal patch, which
Qwen3-VL's prompt names (`inputs/video_clip.py`); GLM-4V's prefill side does not read them.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from encode_server.models.base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch
from encode_server.models.inputs.video_clip import clip_timestamps
from encode_server.models.inputs.video_patches import VideoPatcher
from encode_server.models.layers import aligned_mlp
from encode_server.models.layers.grid_indices import grid_arguments
from encode_server.models.layers.packed_attention import use_packed_attention
from encode_server.models.layers.patch_embed import ItemPixelsForward, patches_as_matmul

#: (height, width) of an image -> the (height, width) the image processor resizes it to.
ImageSize = Callable[[int, int], tuple[int, int]]

#: (tower, pixel patches, grid `[items, 3]`, modality) -> the batch's rows `[tokens, width]`.
RunTower = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, str], torch.Tensor]


class GridVisionAdapter(ItemPixelsForward, EncoderAdapter):
    """A patch-grid vision tower on images (the folder's image processor) and videos (`VideoPatcher`)."""

    def __init__(self, info: ModelInfo, tower: torch.nn.Module, image_processor: Any, video: VideoPatcher,
                 image_size: ImageSize, run_tower: RunTower, device: torch.device, dtype: torch.dtype,
                 video_timestamps: bool = False) -> None:
        # Imported here: it imports transformers' Qwen2-VL and GLM-4V processors.
        from encode_server.models.inputs.fast_patches import accelerated

        self.encoder = torch.nn.ModuleDict({"visual": tower}).to(device=device, dtype=dtype).eval()
        self.tower = self.encoder["visual"]
        self.embeds_parts = patches_as_matmul(self.tower.patch_embed)
        self.packed_attention = use_packed_attention(self.tower)
        on_cuda = torch.device(device).type == "cuda"
        self.padded_mlps = aligned_mlp.align_mlp_widths(self.tower) if on_cuda and aligned_mlp.enabled else 0
        self.image_processor = accelerated(image_processor)
        self.video = video
        self.image_size = image_size
        self.run_tower = run_tower
        self.video_timestamps = video_timestamps
        self.device = device
        self.dtype = dtype
        self.info = info
        config = tower.config
        self.patch_size = int(config.patch_size)
        self.merge_size = int(config.spatial_merge_size)
        # A tower with a 2-D patch embedding (Dots3-Note) names no temporal patch: it takes one frame per patch.
        self.temporal_patch_size = temporal_patch_size = int(getattr(config, "temporal_patch_size", 1))
        for what, processor in (("image", image_processor), ("video", video)):
            if (int(processor.patch_size), int(processor.merge_size)) != (self.patch_size, self.merge_size) or \
                    int(processor.temporal_patch_size) != temporal_patch_size:
                raise ValueError(
                    f"{what} processor (patch {processor.patch_size}, merge {processor.merge_size}, temporal patch "
                    f"{processor.temporal_patch_size}) does not match the vision tower (patch {self.patch_size}, "
                    f"merge {self.merge_size}, temporal patch {temporal_patch_size})")

    def sample_item(self) -> tuple[str, Any]:
        side = 2 * self.patch_size * self.merge_size
        return "image", Image.new("RGB", (side, side), (128, 128, 128))

    # --- layouts ---------------------------------------------------------------------------------

    def _rows(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w) // (self.merge_size**2)

    def _video_layout(self, frames: Any, grid: Sequence[int]) -> ItemLayout:
        timestamps = clip_timestamps(frames, self.video.temporal_patch_size) if self.video_timestamps else None
        return ItemLayout(tokens=self._rows(grid), grid_thw=tuple(int(v) for v in grid), video_timestamps=timestamps)

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
        return ItemLayout(tokens=self._rows(grid), grid_thw=grid)

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
            layouts = [ItemLayout(tokens=self._rows(row), grid_thw=tuple(int(v) for v in row))
                       for row in grid.tolist()]
        return PreparedBatch(modality=modality, layouts=layouts, inputs={"pixel_values": pixels, "grid_thw": grid})

    def tower_rows(self, pixels: Any, grid: torch.Tensor, modality: str) -> torch.Tensor:
        return self.run_tower(self.tower, pixels, grid, modality)


def transformers_class(path: str) -> type:
    """A class by its path under `transformers.models` (imported only when needed)."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def unchanged_size(height: int, width: int) -> tuple[int, int]:
    """The image size of a processor that does not resize."""
    return height, width


def resize_rule(size_of: Callable[..., tuple[int, int]], image_processor: Any, **settings: Any) -> ImageSize:
    """`size_of(height, width, **settings)` as an `ImageSize` that pickles (a preprocessing worker needs it)."""
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


def run_qwen_tower(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor, modality: str) -> torch.Tensor:
    """The rows of a Qwen2-VL or Qwen2.5-VL tower: its merger's output (with its index tensors computed once
    per grid, `layers/grid_indices.py`)."""
    return tower(pixels, grid_thw=grid, **grid_arguments(tower, grid)).pooler_output


def deepstack_count(vision_config: Any) -> int:
    """How many deepstack blocks (Qwen3-VL's) a vision config declares: each adds a row block beside the main rows."""
    return len(getattr(vision_config, "deepstack_visual_indexes", None) or ())


def run_qwen3_tower(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor, modality: str) -> torch.Tensor:
    """The main rows, then each deepstack block, side by side: `[tokens, hidden * (1 + k)]`."""
    output = tower(pixels, grid_thw=grid)
    deepstack = list(getattr(output, "deepstack_features", None) or [])
    return torch.cat([output.pooler_output, *deepstack], dim=-1) if deepstack else output.pooler_output


def load_grid_tower(folder: Path, towers: Mapping[str, tuple[str, str]], what: str,
                    build: Callable[[torch.nn.Module, Any], EncoderAdapter], default_video_processor: str,
                    processors: tuple[Any, Any] | None = None) -> EncoderAdapter:
    """The vision tower of a checkpoint whose `model_type` is in `towers` (-> config class, tower class paths),
    loaded alone (the language model is never built), then `build(tower, image_processor, video_processor)`;
    the folder's processors unless `processors` (image, video) are given."""
    from transformers import AutoImageProcessor

    from encode_server.models.inputs.video_patches import load_video_processor
    from encode_server.models.loading.checkpoint import CheckpointError, load_encoder_modules, read_config

    folder = Path(folder)
    model_type = read_config(folder).get("model_type")
    if model_type not in towers:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not a {what} model")
    config_class, tower_class = (transformers_class(path) for path in towers[model_type])
    vision_config = config_class.from_pretrained(folder).vision_config
    vision_config._attn_implementation = "sdpa"
    modules = load_encoder_modules(folder, lambda: {"visual": tower_class._from_config(vision_config)})
    try:
        if processors is None:
            processors = (AutoImageProcessor.from_pretrained(folder),
                          load_video_processor(folder, default=default_video_processor))
        return build(modules["visual"], *processors)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


def shard_grid_blocks(adapter: EncoderAdapter, mesh: Any, colwise_mlp: Sequence[str], rowwise_mlp: Sequence[str]
                      ) -> None:
    """Attention heads (fused qkv reordered per rank) and MLP columns split over the ranks; mergers stay whole."""
    from encode_server.models.sharding.blocks import check_heads, reorder_fused_qkv, split_linears

    world = mesh.size()
    for block in adapter.encoder["visual"].blocks:
        attention = block.attn
        local = check_heads(attention.num_heads, world, adapter.info.family)
        reorder_fused_qkv(attention.qkv, attention.num_heads, world)
        attention.num_heads = local
        split_linears(attention, mesh, colwise=("qkv",), rowwise=("proj",))
        split_linears(block.mlp, mesh, colwise=colwise_mlp, rowwise=rowwise_mlp)
