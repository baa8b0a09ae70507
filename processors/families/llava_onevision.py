"""LLaVA-OneVision's processor: anyres tiles (the base tile, then the tiles of the best grid pinpoint) through the
folder's image processor, each item keeping its own tiles; its rows are the placeholders the full processor
inserts (`LlavaOnevisionProcessor._get_number_of_features`, the unpadded tile map plus a newline per map row,
minus the class token where "default" drops it), counted with the library's own methods."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from processors.base import ItemLayout, PreparedBatch
from processors.vision_part import ImageProcessorBase, as_images


class PlaceholderCounter:
    """The full processor's image-token count, with its own methods, without building it (its video half needs
    torchvision). A module-level class, so that the processor pickles."""

    def __init__(self, image_processor: Any, num_image_tokens: int, vision_aspect_ratio: str,
                 vision_feature_select_strategy: str | None) -> None:
        self.image_processor = image_processor
        self.num_image_tokens = num_image_tokens
        self.vision_aspect_ratio = vision_aspect_ratio
        self.vision_feature_select_strategy = vision_feature_select_strategy
        size = image_processor.size
        self.tile = (int(size.height), int(size.width)) if size.height else (int(size.shortest_edge),) * 2

    def _get_unpadded_features(self, *args: Any) -> Any:
        from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

        return LlavaOnevisionProcessor._get_unpadded_features(self, *args)

    def __call__(self, height: int, width: int) -> int:
        from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

        # As `replace_image_token` in single-image mode: the processed tile size is the processor's `size`.
        count = LlavaOnevisionProcessor._get_number_of_features(self, height, width, *self.tile)
        return count - 1 if self.vision_feature_select_strategy == "default" else count


class LlavaOnevisionProcessor(ImageProcessorBase):
    """Anyres-tiled images through the folder's image processor; rows counted by the full processor's rule."""

    def __init__(self, image_processor: Any, counter: PlaceholderCounter, grid_pinpoints: list[list[int]],
                 tile_size: int, patch_size: int) -> None:
        self.image_processor = image_processor
        self.count_placeholders = counter
        self.grid_pinpoints = grid_pinpoints
        self.tile_size = int(tile_size)
        self.patch_grid = self.tile_size // int(patch_size)

    def tiles(self, height: int, width: int) -> int:
        """Tiles (base included) the model takes for an image of this size, by the model's own rule."""
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        return int(image_size_to_num_patches([height, width], self.grid_pinpoints, self.tile_size))

    def _layout(self, height: int, width: int) -> ItemLayout:
        return ItemLayout(tokens=int(self.count_placeholders(height, width)),
                          grid_thw=(self.tiles(height, width), self.patch_grid, self.patch_grid))

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        (image,) = as_images([item])
        width, height = image.size
        return self._layout(height, width)

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        processed = self.image_processor(images=as_images(items), return_tensors="pt")
        sizes = processed["image_sizes"]
        layouts = [self._layout(int(h), int(w)) for h, w in sizes.tolist()]
        # Drop the processor's per-batch padding of the tile dimension: each item keeps its own tiles.
        tiles = torch.cat([pixels[:layout.grid_thw[0]] for pixels, layout in zip(processed["pixel_values"], layouts)])
        return PreparedBatch(modality=modality, inputs={"pixel_values": tiles, "image_sizes": sizes}, layouts=layouts)
