"""Mistral 3 (`model_type` "mistral3"): Pixtral tower at the image's own size, patch merger, projector.

**Which rows we ship, and why.** The full processor (`PixtralProcessor`) replaces an image with a
`h x w` grid of tokens in the merged patch grid: each grid row is `w` x `[IMG]` followed by
`[IMG_BREAK]`, and the last `[IMG_BREAK]` becomes `[IMG_END]`: `h * (w + 1)` tokens in all.
`Mistral3Model.get_image_features` yields `h * w` rows per image (row-major over the merged grid),
and `Mistral3Model.forward` splices them with `masked_scatter` into the positions where
`input_ids == image_token_id` (`[IMG]`) only; `[IMG_BREAK]` and `[IMG_END]` are ordinary text tokens
embedded by the language model's own table. So we ship exactly `get_image_features`' rows: `h * w`
rows, one per `[IMG]` token in prompt order, and the prefill side splices them the same way
(`[IMG]` positions, in order). No rows for the break and end tokens: the encoder does not hold the
language model's embedding table, and shipping them would break the one-row-per-`[IMG]` splice.
`grid_thw` is `[1, h, w]`, from which the prefill side can also lay out the `h * (w + 1)` tokens.
(`PixtralProcessor._get_num_multimodal_tokens` reports `h * (w + 1)`, the prompt span with breaks.)

Sizes: the processor resizes an image so its longest edge fits `size["longest_edge"]`, rounding each
side up to a multiple of `patch_size * spatial_merge_size` of the *processor* (it overrides the image
processor's own `patch_size` with that product on every call); the model must agree
(`vision_config.patch_size * spatial_merge_size`), which is checked at load. The image processor
pads a batch to its largest image; the tower crops each image back to its own size and attends
within each image only (a block-diagonal mask), so fused items give the same rows as alone. Per-item
inputs are fused by `collate`, which pads exactly as one processor call on all items would. Because
the block mask is `patches^2`, a forward runs the items in groups of at most
`MAX_PATCHES_PER_FORWARD` patches (an image larger than that runs alone). Tensor parallel: the
Pixtral blocks are sharded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part
from processors.base import PreparedBatch
from processors.families.mistral3 import Mistral3Processor
from processors.vision_part import processor_settings, source_init_defaults

MAX_PATCHES_PER_FORWARD = 4096  # bounds the tower's patches^2 attention mask per forward


class Mistral3Adapter(VisionPartAdapter):
    """Runs `Mistral3Model.get_image_features` (vision part only) on images at their own (resized) size."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, processor: Mistral3Processor,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "mistral3", model, config.text_config.hidden_size, processor, device, dtype)
        self.tower_patch = int(config.vision_config.patch_size)

    def groups(self, sizes: list[list[int]]) -> list[list[int]]:
        """Item indices in forward groups of at most MAX_PATCHES_PER_FORWARD tower patches."""
        groups: list[list[int]] = []
        total = 0
        for index, (height, width) in enumerate(sizes):
            patches = (height // self.tower_patch) * (width // self.tower_patch)
            if not groups or total + patches > MAX_PATCHES_PER_FORWARD:
                groups.append([])
                total = 0
            groups[-1].append(index)
            total += patches
        return groups

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        sizes = batch.inputs["image_sizes"]
        pixels = batch.inputs["pixel_values"]
        parts = []
        for group in self.groups(sizes.tolist()):
            group_sizes = sizes[group]
            height, width = (int(v) for v in group_sizes.max(dim=0).values)
            features = self.model.get_image_features(pixel_values=self.to_device(pixels[group, :, :height, :width]),
                                                     image_sizes=self.to_device(group_sizes))
            parts.append(self.flat_rows(features.pooler_output))
        return torch.cat(parts)


def merged_patch_size(config: Any, settings: dict[str, Any]) -> int:
    """The processor's `patch_size * spatial_merge_size` (folder, else its `__init__` defaults), checked against
    the model's."""
    # PixtralProcessor's module imports torchvision, so its defaults are read from its source, not imported.
    defaults = source_init_defaults("transformers.models.pixtral.processing_pixtral", "PixtralProcessor")
    patch = int(settings.get("patch_size", defaults["patch_size"]))
    merge = int(settings.get("spatial_merge_size", defaults["spatial_merge_size"]))
    model_patch = int(config.vision_config.patch_size) * int(config.spatial_merge_size)
    if patch * merge != model_patch:
        raise CheckpointError(f"mistral3: the processor's patch_size x spatial_merge_size = {patch} x {merge} "
                              f"but the model merges {config.vision_config.patch_size} x {config.spatial_merge_size}")
    return model_patch


def mistral3_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> Mistral3Adapter:
    """The vision part (Pixtral tower, projector with patch merger) of a Mistral 3 checkpoint."""
    from transformers import AutoConfig, AutoImageProcessor, Mistral3Model

    config = AutoConfig.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    merged = merged_patch_size(config, processor_settings(folder))
    model = load_vision_part(folder, Mistral3Model, config, device, dtype)
    return Mistral3Adapter(folder.name, model, config, Mistral3Processor(image_processor, merged), device, dtype)


def shard_mistral3(adapter: Any, mesh: Any) -> None:
    """Shard the Pixtral blocks: q/k/v and gate/up column-wise, o_proj and down_proj row-wise."""
    from encode_server.models.sharding.blocks import check_heads, split_linears

    world = mesh.size()
    for layer in adapter.model.vision_tower.transformer.layers:
        attention = layer.attention
        attention.num_heads = check_heads(attention.num_heads, world, "mistral3")
        split_linears(attention, mesh, colwise=("q_proj", "k_proj", "v_proj"), rowwise=("o_proj",))
        split_linears(layer.feed_forward, mesh, colwise=("gate_proj", "up_proj"), rowwise=("down_proj",))


FAMILY = Family(
    name="mistral3",
    model_types=("mistral3",),
    modalities=("image",),
    row_formula="`h*w`, one row per `[IMG]` token (`[IMG_BREAK]`/`[IMG_END]` get none)",
    grid_thw="`[1, h, w]`, the merged patch grid of the resized image",
    load=mistral3_from_folder,
    shard=shard_mistral3,
)
