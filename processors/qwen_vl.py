"""Qwen2.5-VL vision tower and merger as an encoder adapter (images).

An image of `h x w` pixels is resized by the processor to multiples of `patch_size * merge_size`,
cut into a `1 x gh x gw` grid of patches, and merged `merge_size^2` patches to one output row, so
it yields `gh * gw / merge_size^2` rows. The tower attends within each image (and its windows)
only, so an image's rows do not depend on the other images fused into the same forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from .base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch


class QwenVisionAdapter(EncoderAdapter):
    """Runs a `Qwen2_5_VisionTransformerPretrainedModel` on images prepared by a Qwen2-VL processor."""

    def __init__(self, name: str, tower: torch.nn.Module, image_processor: Any,
                 device: torch.device, dtype: torch.dtype, family: str = "qwen2_5_vl") -> None:
        self.tower = tower.to(device=device, dtype=dtype).eval()
        self.image_processor = image_processor
        self.device = device
        self.dtype = dtype
        config = tower.config
        self.merge_size = int(config.spatial_merge_size)
        self.info = ModelInfo(name=name, family=family, modalities=("image",),
                              hidden_size=int(config.out_hidden_size))
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

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if not isinstance(item, Image.Image):
            raise ItemError(f"expected an image, got {type(item).__name__}")
        width, height = item.size
        factor = self.patch_size * self.merge_size
        try:
            resized_h, resized_w = smart_resize(height, width, factor=factor,
                                                min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as exc:
            raise ItemError(f"image of {width}x{height} pixels: {exc}") from None
        grid_h, grid_w = resized_h // self.patch_size, resized_w // self.patch_size
        return ItemLayout(tokens=grid_h * grid_w // (self.merge_size**2), grid_thw=(1, grid_h, grid_w))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        processed = self.image_processor(images=list(items), return_tensors="pt")
        grid = processed["image_grid_thw"]
        layouts = [
            ItemLayout(tokens=int(t * h * w) // (self.merge_size**2), grid_thw=(int(t), int(h), int(w)))
            for t, h, w in grid.tolist()
        ]
        return PreparedBatch(modality=modality, layouts=layouts,
                             inputs={"pixel_values": processed["pixel_values"], "grid_thw": grid})

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = batch.inputs["pixel_values"].to(device=self.device, dtype=self.dtype, non_blocking=True)
        grid = batch.inputs["grid_thw"].to(self.device)
        rows = self.tower(pixels, grid_thw=grid).pooler_output
        return rows.to("cpu").contiguous()
