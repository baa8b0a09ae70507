"""Qwen3-VL (dense and MoE) and Qwen3.5 vision towers as one encoder family: images and videos.

The tower (`Qwen3VLVisionModel` and its MoE / Qwen3.5 twins) embeds `patch x patch` patches (16 in
the published models) with a learned position grid resampled to each item, runs its blocks, and
merges every `merge x merge` patches into one row of `out_hidden_size`. Qwen3-VL also returns
**deepstack** features: the hidden states after the blocks in `deepstack_visual_indexes`, each
through its own merger, which the language model adds to its first layers. Rows are shipped as
`torch.cat([main] + deepstack, dim=-1)`: `[tokens, out_hidden_size * (1 + k)]`, `k =
len(deepstack_visual_indexes)` (`ModelInfo.deepstack`). Qwen3.5's tower is the same one without
deepstack (`k = 0`).

Images: the folder's image processor (`Qwen2VLImageProcessorPil`), `1 x h x w` grids. Videos: the
folder's `Qwen3VLVideoProcessor` settings (its clip-wide `smart_resize`, the optional per-frame
pixel cap) applied by `VideoPatcher` without torchvision; a `t x h x w` grid, `t` = frames / 2
rounded up. The prompt's per-frame timestamps are the prefill side's business; the rows are the
same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .base import EncoderAdapter, ModelInfo
from .family import Family
from .grid_vision import GridVisionAdapter
from .video_patches import VideoPatcher, load_video_processor

BUILTIN_SEED = 1234

#: model_type -> (config class, vision tower class), both under `transformers.models`.
_TOWERS = {
    "qwen3_vl": ("qwen3_vl.configuration_qwen3_vl.Qwen3VLConfig",
                 "qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeConfig",
                     "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel"),
    "qwen3_5": ("qwen3_5.configuration_qwen3_5.Qwen3_5Config",
                "qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeConfig",
                    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel"),
}


def _transformers_class(path: str) -> type:
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def deepstack_count(vision_config: Any) -> int:
    return len(getattr(vision_config, "deepstack_visual_indexes", None) or ())


def run_qwen3_tower(tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor, modality: str) -> torch.Tensor:
    """The main rows, then each deepstack block, side by side: `[tokens, hidden * (1 + k)]`."""
    output = tower(pixels, grid_thw=grid)
    deepstack = list(getattr(output, "deepstack_features", None) or [])
    return torch.cat([output.pooler_output, *deepstack], dim=-1) if deepstack else output.pooler_output


def image_size_of(image_processor: Any) -> Callable[[int, int], tuple[int, int]]:
    """How `Qwen2VLImageProcessorPil.resize` sizes an image."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    size = image_processor.size
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    if not image_processor.do_resize:
        return lambda height, width: (height, width)
    return lambda height, width: smart_resize(height, width, factor=factor, min_pixels=size.shortest_edge,
                                              max_pixels=size.longest_edge)


def build_adapter(name: str, tower: torch.nn.Module, image_processor: Any, video_processor: Any,
                  device: torch.device, dtype: torch.dtype) -> GridVisionAdapter:
    config = tower.config
    info = ModelInfo(name=name, family="qwen3_vl", modalities=("image", "video"),
                     hidden_size=int(config.out_hidden_size), deepstack=deepstack_count(config))
    video = VideoPatcher(video_processor)
    return GridVisionAdapter(info, tower, image_processor, video, image_size_of(image_processor), run_qwen3_tower,
                             device, dtype)


def load(folder: Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The vision tower (mergers included) of a Qwen3-VL / Qwen3.5 checkpoint; the language model is never built."""
    from transformers import AutoImageProcessor

    from .checkpoint import CheckpointError, load_encoder_modules, read_config

    folder = Path(folder)
    model_type = read_config(folder).get("model_type")
    if model_type not in _TOWERS:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not a Qwen3-VL / Qwen3.5 model")
    config_class, tower_class = (_transformers_class(path) for path in _TOWERS[model_type])
    vision_config = config_class.from_pretrained(folder).vision_config
    vision_config._attn_implementation = "sdpa"
    modules = load_encoder_modules(folder, lambda: {"visual": tower_class._from_config(vision_config)})
    try:
        image_processor = AutoImageProcessor.from_pretrained(folder)
        video_processor = load_video_processor(folder, default="Qwen3VLVideoProcessor")
        return build_adapter(folder.name, modules["visual"], image_processor, video_processor, device, dtype)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


def shard(adapter: EncoderAdapter, mesh: Any) -> None:
    """Attention heads and MLP columns split over the ranks; the mergers (deepstack ones too) stay whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from .sharding import check_heads, reorder_fused_qkv

    world = mesh.size()
    for block in adapter.encoder["visual"].blocks:
        attention = block.attn
        local = check_heads(attention.num_heads, world, adapter.info.family)
        reorder_fused_qkv(attention.qkv, attention.num_heads, world)
        attention.num_heads = local
        parallelize_module(attention, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
        parallelize_module(block.mlp, mesh, {"linear_fc1": ColwiseParallel(), "linear_fc2": RowwiseParallel()})


def tiny_qwen3_vl(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """A built-in Qwen3-VL tower: 4 blocks of width 128, patch 16, merge 2, deepstack after blocks 1 and 2."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    config = Qwen3VLVisionConfig(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
                                 patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                 num_position_embeddings=256, deepstack_visual_indexes=[1, 2])
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        tower = Qwen3VLVisionModel._from_config(config).float()
    # Up to 512x512 pixels per image (256 rows), and per frame of a video, keeping CPU forwards short.
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=64 * 64, max_pixels=512 * 512,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": 64 * 64, "longest_edge": 512 * 512 * 16},
                                            cap_pixels_per_frame=True, max_video_tokens=256,
                                            image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return build_adapter("tiny-qwen3-vl", tower, image_processor, video_processor, device, dtype)


FAMILY = Family(
    name="qwen3_vl",
    model_types=tuple(_TOWERS),
    modalities=("image", "video"),
    row_formula="t*h*w/merge^2 per item (t = 1 for an image, frames/2 rounded up for a video); "
                "each row is main + deepstack features: out_hidden_size * (1 + len(deepstack_visual_indexes)) wide",
    grid_thw="[t, h, w] in patches of patch_size (16), before merging",
    load=load,
    builtins={"tiny-qwen3-vl": tiny_qwen3_vl},
    shard=shard,
)
