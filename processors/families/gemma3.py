"""Gemma 3's processor: every image the image processor emits (the image, then its pan-and-scan crops, only when
the full processor's call-time kwargs ask for them) becomes `mm_tokens_per_image` rows; `grid_thw` is
`[1 + crops, k, k]` with `k * k = mm_tokens_per_image`. The crop count is the library's own rule, on the image's
shape alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from processors.base import ItemLayout, PreparedBatch
from processors.vision_part import ImageProcessorBase, as_images

PAN_AND_SCAN_KEYS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                     "pan_and_scan_min_ratio_to_activate")


class Gemma3Processor(ImageProcessorBase):
    """Images and their pan-and-scan crops through the folder's image processor, with the full processor's
    `images_kwargs`."""

    def __init__(self, image_processor: Any, images_kwargs: Mapping[str, Any], tokens_per_image: int) -> None:
        self.image_processor = image_processor
        self.images_kwargs = dict(images_kwargs)
        self.tokens_per_image = int(tokens_per_image)
        self.side = int(self.tokens_per_image**0.5)

    def crops(self, width: int, height: int) -> int:
        """How many pan-and-scan crops the processor adds for an image of this size (the library's own rule)."""
        if not self.images_kwargs.get("do_pan_and_scan"):
            return 0
        # The rule reads only the image's shape; a broadcast view costs no memory. The PIL backend's rule
        # takes an array, the torchvision backend's (what transformers picks where torchvision is) a tensor.
        settings = {key: self.images_kwargs[key] for key in PAN_AND_SCAN_KEYS[1:]}
        if hasattr(self.image_processor, "pan_and_scan"):
            return len(self.image_processor.pan_and_scan(image=np.broadcast_to(np.uint8(0), (3, height, width)),
                                                         **settings))
        return len(self.image_processor.pan_and_scan_batched(torch.zeros(1).expand(3, height, width), **settings))

    def _layout(self, crops: int) -> ItemLayout:
        return ItemLayout(tokens=self.tokens_per_image * (1 + crops), grid_thw=(1 + crops, self.side, self.side))

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        (image,) = as_images([item])
        return self._layout(self.crops(*image.size))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        processed = self.image_processor(images=as_images(items), return_tensors="pt", **self.images_kwargs)
        return PreparedBatch(modality=modality, inputs={"pixel_values": processed["pixel_values"]},
                             layouts=[self._layout(int(n)) for n in processed["num_crops"]])
