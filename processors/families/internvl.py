"""InternVL's processor: every image tiled as the full processor tiles it (`InternVLProcessor` passes
`crop_to_patches=True` on every call, whatever the folder's image processor config says), each tile
`tokens_per_tile` rows; `grid_thw` is `[tiles, patch rows, patch columns]` of one tile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

from processors.base import ItemError, ItemLayout, PreparedBatch, Processor

#: What `InternVLProcessor` passes its image processor on every call (its `images_kwargs`), whatever the folder's
#: image processor config says: the prefill side tiles every image, so the rows are per tile.
FULL_PROCESSOR_CALL = {"crop_to_patches": True}


class InternVLProcessor(Processor):
    """Images to tiles through the folder's image processor, with the full processor's call kwargs."""

    modalities = ("image",)

    def __init__(self, image_processor: Any, patch_grid: tuple[int, int], tokens_per_tile: int) -> None:
        self.image_processor = image_processor
        self.patch_grid = patch_grid
        self.tokens_per_tile = tokens_per_tile

    def sample_item(self) -> tuple[str, Any]:
        return "image", Image.new("RGB", (64, 64), (128, 128, 128))

    def _layout(self, tiles: int) -> ItemLayout:
        return ItemLayout(tokens=tiles * self.tokens_per_tile, grid_thw=(tiles, *self.patch_grid))

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if not isinstance(item, Image.Image):
            raise ItemError(f"expected an image, got {type(item).__name__}")
        width, height = item.size
        return self._layout(int(self.image_processor.get_number_of_image_patches(height, width,
                                                                                  dict(FULL_PROCESSOR_CALL))))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        processed = self.image_processor(images=list(items), return_tensors="pt", **FULL_PROCESSOR_CALL)
        tiles = [int(n) for n in processed["num_patches"]]
        return PreparedBatch(modality=modality, layouts=[self._layout(n) for n in tiles],
                             inputs={"pixel_values": processed["pixel_values"]})
