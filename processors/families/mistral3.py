"""Mistral 3's processor: an image resized so its longest edge fits the image processor's `longest_edge`, each side
rounded up to a multiple of the full processor's `patch_size * spatial_merge_size` (which it passes on every
call); `h x w` merged patches, one row each, `grid_thw` `[1, h, w]`. Per-item inputs fuse as one processor call
on all items would: zero-padded to the largest height and width."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from processors.base import ItemLayout, PreparedBatch
from processors.vision_part import ImageProcessorBase, as_images


class Mistral3Processor(ImageProcessorBase):
    """Images at their own (resized) size through the folder's Pixtral image processor."""

    def __init__(self, image_processor: Any, merged_patch: int) -> None:
        self.image_processor = image_processor
        self.merged_patch = merged_patch  # pixels per side of one row's square (patch_size * spatial_merge_size)

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The processed image's size, by the image processor's own rule."""
        from transformers.image_utils import ChannelDimension
        from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

        if not self.image_processor.do_resize:
            return height, width
        size = self.image_processor.size
        edges = (size.longest_edge, size.longest_edge) if size.longest_edge else (size.height, size.width)
        shape_only = np.broadcast_to(np.uint8(0), (3, height, width))  # the rule reads only the shape
        return get_resize_output_image_size(shape_only, size=edges, patch_size=(self.merged_patch,) * 2,
                                            input_data_format=ChannelDimension.FIRST)

    def _layout(self, height: int, width: int) -> ItemLayout:
        rows, columns = height // self.merged_patch, width // self.merged_patch
        return ItemLayout(tokens=rows * columns, grid_thw=(1, rows, columns))

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        (image,) = as_images([item])
        width, height = image.size
        return self._layout(*self.resized(height, width))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        patch = {"height": self.merged_patch, "width": self.merged_patch}
        processed = self.image_processor(images=as_images(items), patch_size=patch, return_tensors="pt")
        sizes = processed["image_sizes"]
        inputs = {"pixel_values": processed["pixel_values"], "image_sizes": sizes}
        return PreparedBatch(modality=modality, inputs=inputs,
                             layouts=[self._layout(int(h), int(w)) for h, w in sizes.tolist()])

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Per-item batches fused as one processor call would: zero-padded to the largest height and width."""
        pixels = [batch.inputs["pixel_values"] for batch in batches]
        height, width = max(p.shape[-2] for p in pixels), max(p.shape[-1] for p in pixels)
        padded = [torch.nn.functional.pad(p, (0, width - p.shape[-1], 0, height - p.shape[-2])) for p in pixels]
        return PreparedBatch(modality=batches[0].modality,
                             inputs={"pixel_values": torch.cat(padded),
                                     "image_sizes": torch.cat([batch.inputs["image_sizes"] for batch in batches])},
                             layouts=[layout for batch in batches for layout in batch.layouts])
