"""The internvl family: InternVL (`-hf` layout) vision tower and projector on tiled images.

The processor (GotOcr2, PIL backend) cuts an image into `cols x rows` tiles of the tower's input
size, chosen to match the image's aspect ratio within `[min_patches, max_patches]`, and adds a
thumbnail of the whole image when there is more than one tile. Every tile runs through the tower on
its own; its patch features are pixel-shuffled by `downsample_ratio` and projected, giving the same
number of rows per tile. So slicing is in tile space: an item's rows are its tiles times the rows
per tile, and tiles of different requests fuse freely in one forward.

`grid_thw` for a tiled item is `[tiles, h, w]`: the tile count (thumbnail included) and the tower's
patch grid of one tile, so that `tokens = tiles * h * w * downsample_ratio^2`, just as Qwen's
`tokens = t * h * w / merge^2`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.builtin import seeded
from encode_server.models.family import Family
from processors.base import PreparedBatch
from processors.families.internvl import InternVLProcessor


def pixel_shuffle(features: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """InternVL's pixel shuffle: `(B, W, H, C)` to `(B, W*s, H*s, C/s^2)`, as `transformers` does it."""
    batch, width, height, channels = features.shape
    features = features.view(batch, width, int(height * scale_factor), int(channels / scale_factor))
    features = features.permute(0, 2, 1, 3).contiguous()
    features = features.view(batch, int(height * scale_factor), int(width * scale_factor),
                             int(channels / (scale_factor**2)))
    return features.permute(0, 2, 1, 3).contiguous()


class InternVLAdapter(EncoderAdapter):
    """Runs an `InternVLVisionModel` plus `InternVLMultiModalProjector` on the tiles of images."""

    def __init__(self, name: str, vision_tower: torch.nn.Module, projector: torch.nn.Module, config: Any,
                 processor: InternVLProcessor, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = torch.nn.ModuleDict({"vision_tower": vision_tower, "multi_modal_projector": projector})
        self.encoder.to(device=device, dtype=dtype).eval()
        self.processor = processor
        self.device = device
        self.dtype = dtype
        self.downsample_ratio = float(config.downsample_ratio)
        self.feature_layer = config.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise ValueError(f"vision_feature_layer {self.feature_layer!r}: only a single layer is supported")
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.info = ModelInfo(name=name, family="internvl", modalities=("image",),
                              hidden_size=int(config.text_config.hidden_size))

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = batch.inputs["pixel_values"].to(device=self.device, dtype=self.dtype, non_blocking=True)
        tower, projector = self.encoder["vision_tower"], self.encoder["multi_modal_projector"]
        if self.feature_layer == -1:
            features = tower(pixel_values=pixels).last_hidden_state
        else:
            features = tower(pixel_values=pixels, output_hidden_states=True).hidden_states[self.feature_layer]
        if self.drop_cls:
            features = features[:, 1:, :]
        tiles, patches, _ = features.shape
        side = int(patches**0.5)
        features = pixel_shuffle(features.reshape(tiles, side, side, -1), self.downsample_ratio)
        rows = projector(features.reshape(tiles, -1, features.shape[-1]))
        return rows.reshape(-1, rows.shape[-1]).to("cpu").contiguous()


def internvl_processor(config: Any, image_processor: Any) -> InternVLProcessor:
    """The tiles' processor, after checking that the image processor's tiles are the tower's input size."""
    vision = config.vision_config
    image_size = vision.image_size if isinstance(vision.image_size, (list, tuple)) else [vision.image_size] * 2
    patch_size = vision.patch_size if isinstance(vision.patch_size, (list, tuple)) else [vision.patch_size] * 2
    patch_grid = (int(image_size[0]) // int(patch_size[0]), int(image_size[1]) // int(patch_size[1]))
    tile = image_processor.size
    if (int(tile.height), int(tile.width)) != (int(image_size[0]), int(image_size[1])):
        raise ValueError(f"processor tiles of {tile.height}x{tile.width} do not match the tower's input "
                         f"size {image_size[0]}x{image_size[1]}")
    tokens_per_tile = int(patch_grid[0] * patch_grid[1] * float(config.downsample_ratio)**2)
    return InternVLProcessor(image_processor, patch_grid, tokens_per_tile)


def build_internvl_encoder(config: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The vision tower and projector of an `InternVLConfig` (no language model)."""
    from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector, InternVLVisionModel

    config.vision_config._attn_implementation = "sdpa"
    return InternVLVisionModel._from_config(config.vision_config), InternVLMultiModalProjector(config)


def internvl_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> InternVLAdapter:
    """The vision tower and projector of an InternVL (`-hf` layout) checkpoint."""
    from transformers import AutoImageProcessor, InternVLConfig

    from encode_server.models.loading.checkpoint import load_encoder_modules

    config = InternVLConfig.from_pretrained(folder)
    modules = load_encoder_modules(folder, lambda: dict(zip(("vision_tower", "multi_modal_projector"),
                                                            build_internvl_encoder(config))))
    processor = internvl_processor(config, AutoImageProcessor.from_pretrained(folder))
    return InternVLAdapter(folder.name, modules["vision_tower"], modules["multi_modal_projector"], config,
                           processor, device, dtype)


def tiny_internvl_config():
    from transformers import InternVLConfig

    return InternVLConfig(
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=[56, 56], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
        downsample_ratio=0.5,
    )


def tiny_internvl(device: torch.device, dtype: torch.dtype) -> InternVLAdapter:
    """`tiny-internvl`: 2 layers, width 64, 56x56 tiles of 14x14 patches; 1 to 6 tiles plus a thumbnail."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    config = tiny_internvl_config()
    vision_tower, projector = seeded(lambda: build_internvl_encoder(config))
    processor = GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=6,
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
    )
    return InternVLAdapter("tiny-internvl", vision_tower.float(), projector.float(), config,
                           internvl_processor(config, processor), device, dtype)


def shard_internvl(adapter: InternVLAdapter, mesh: Any) -> None:
    """Every layer: q, k, v column-wise and the output projection row-wise; the MLP's fc1 and fc2 alike."""
    from encode_server.models.sharding.blocks import ShardingError, check_heads, split_linears

    world = mesh.size()
    for layer in adapter.encoder["vision_tower"].encoder.layer:
        attention = layer.attention
        if not isinstance(attention.q_norm, torch.nn.Identity):
            raise ShardingError("internvl: towers with qk-norm normalise across all heads; "
                                "tensor parallelism is not supported for them")
        local = check_heads(attention.num_heads, world, "internvl")
        attention.num_heads, attention.embed_dim = local, attention.embed_dim // world
        split_linears(attention, mesh, colwise=["q_proj", "k_proj", "v_proj"], rowwise=["projection_layer"])
        split_linears(layer.mlp, mesh, colwise=["fc1"], rowwise=["fc2"])


FAMILY = Family(
    name="internvl",
    model_types=("internvl",),
    modalities=("image",),
    row_formula="`tiles * h*w * downsample_ratio^2`",
    grid_thw="`[tiles (thumbnail included), h, w]`, `h x w` = one tile's patch grid",
    load=internvl_from_folder,
    builtins={"tiny-internvl": tiny_internvl},
    shard=shard_internvl,
)
