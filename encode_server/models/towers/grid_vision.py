"""The adapter shared by vision towers fed Qwen-style patches and a `(t, h, w)` grid per item.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL (and Qwen3.5), GLM-4V, GLM-5-Next, Dots3-Note and the Omni thinkers' vision
towers (`omni_thinker.py`) take what a `processors.grid.GridProcessor` makes of an image or a video (patches on a
`t x h x w` grid, every `merge x merge` patches merged into one output row) and give `t * h * w / merge^2` rows
per item. What differs per family is how the tower is run (`run_tower`, which returns the rows); the Qwen towers'
run functions, which several families use, are here, and `grid_adapter` checks at load that the processor
patches items as the tower takes them.

Rows never depend on the items fused beside them: these towers attend within each item only (or within
windows of it, Qwen2.5-Omni's), and their position embeddings come from each item's own grid.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.layers import aligned_mlp
from encode_server.models.layers.grid_indices import grid_arguments
from encode_server.models.layers.packed_attention import use_packed_attention
from encode_server.models.layers.patch_embed import ItemPixelsForward, patches_as_matmul
from processors.grid import GridProcessor

#: (tower, pixel patches, grid `[items, 3]`, modality) -> the batch's rows `[tokens, width]`.
RunTower = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, str], torch.Tensor]


class GridVisionAdapter(ItemPixelsForward, EncoderAdapter):
    """A patch-grid vision tower on what a `GridProcessor` prepares (images and videos)."""

    def __init__(self, info: ModelInfo, tower: torch.nn.Module, processor: GridProcessor, run_tower: RunTower,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = torch.nn.ModuleDict({"visual": tower}).to(device=device, dtype=dtype).eval()
        self.tower = self.encoder["visual"]
        self.embeds_parts = patches_as_matmul(self.tower.patch_embed)
        self.packed_attention = use_packed_attention(self.tower)
        on_cuda = torch.device(device).type == "cuda"
        self.padded_mlps = aligned_mlp.align_mlp_widths(self.tower) if on_cuda and aligned_mlp.enabled else 0
        self.processor = processor
        self.run_tower = run_tower
        self.device = device
        self.dtype = dtype
        self.info = info

    def tower_rows(self, pixels: Any, grid: torch.Tensor, modality: str) -> torch.Tensor:
        return self.run_tower(self.tower, pixels, grid, modality)


def check_grid(processor: GridProcessor, tower_config: Any) -> None:
    """A `ValueError` unless the processor's image and video patching (patch, merge, temporal patch) are the
    tower's; a tower with a 2-D patch embedding (Dots3-Note) names no temporal patch: it takes one frame per
    patch."""
    tower = (int(tower_config.patch_size), int(tower_config.spatial_merge_size),
             int(getattr(tower_config, "temporal_patch_size", 1)))
    for what, (patch, merge, temporal) in processor.grid_settings().items():
        if (patch, merge, temporal) != tower:
            raise ValueError(
                f"{what} processor (patch {patch}, merge {merge}, temporal patch {temporal}) does not match the "
                f"vision tower (patch {tower[0]}, merge {tower[1]}, temporal patch {tower[2]})")


def grid_adapter(info: ModelInfo, tower: torch.nn.Module, processor: GridProcessor, run_tower: RunTower,
                 device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    """A `GridVisionAdapter`, after checking that the processor patches items as the tower takes them."""
    check_grid(processor, tower.config)
    return GridVisionAdapter(info, tower, processor, run_tower, device, dtype)


def transformers_class(path: str) -> type:
    """A class by its path under `transformers.models` (imported only when needed)."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


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

    from encode_server.models.loading.checkpoint import CheckpointError, load_encoder_modules, read_config
    from processors.video_patches import load_video_processor

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
