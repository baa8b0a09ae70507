"""The adapter shared by vision towers fed Qwen-style patches and a `(t, h, w)` grid per item.

Qwen3-VL (and Qwen3.5) and GLM-4V cut an image or a video into `patch x patch` patches on a
`t x h x w` grid (`t` counts groups of `temporal_patch_size` frames; an image is one group) and merge
every `merge x merge` patches into one output row: `t * h * w / merge^2` rows per item. Images go
through the family's PIL image processor in one call for the batch; videos through `VideoPatcher`
(the family's video processor settings, no torchvision). What differs per family is how the image
size is chosen (`image_size`) and how the tower is run (`run_tower`, which returns the rows).

Rows never depend on the items fused beside them: these towers attend within each frame of each
item only, and their position embeddings come from each item's own grid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from .base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch
from .video_patches import VideoPatcher

#: (height, width) of an image -> the (height, width) the image processor resizes it to.
ImageSize = Callable[[int, int], tuple[int, int]]

#: (tower, pixel patches, grid `[items, 3]`, modality) -> the batch's rows `[tokens, width]`.
RunTower = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, str], torch.Tensor]


class GridVisionAdapter(EncoderAdapter):
    """A patch-grid vision tower on images (PIL image processor) and videos (`VideoPatcher`)."""

    def __init__(self, info: ModelInfo, tower: torch.nn.Module, image_processor: Any, video: VideoPatcher,
                 image_size: ImageSize, run_tower: RunTower, device: torch.device, dtype: torch.dtype) -> None:
        self.encoder = torch.nn.ModuleDict({"visual": tower}).to(device=device, dtype=dtype).eval()
        self.tower = self.encoder["visual"]
        self.image_processor = image_processor
        self.video = video
        self.image_size = image_size
        self.run_tower = run_tower
        self.device = device
        self.dtype = dtype
        self.info = info
        config = tower.config
        self.patch_size = int(config.patch_size)
        self.merge_size = int(config.spatial_merge_size)
        for what, processor in (("image", image_processor), ("video", video)):
            if (int(processor.patch_size), int(processor.merge_size)) != (self.patch_size, self.merge_size) or \
                    int(processor.temporal_patch_size) != int(config.temporal_patch_size):
                raise ValueError(
                    f"{what} processor (patch {processor.patch_size}, merge {processor.merge_size}, temporal patch "
                    f"{processor.temporal_patch_size}) does not match the vision tower (patch {self.patch_size}, "
                    f"merge {self.merge_size}, temporal patch {config.temporal_patch_size})")

    def sample_item(self) -> tuple[str, Any]:
        side = 2 * self.patch_size * self.merge_size
        return "image", Image.new("RGB", (side, side), (128, 128, 128))

    # --- layouts ---------------------------------------------------------------------------------

    def _rows(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w) // (self.merge_size**2)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "video":
            grid = self.video.layout(item).grid_thw
        else:
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
        else:
            for item in items:  # the processor would fail the whole batch on one bad item
                self.item_layout(modality, item)
            processed = self.image_processor(images=list(items), return_tensors="pt")
            pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
        layouts = [ItemLayout(tokens=self._rows(row), grid_thw=tuple(int(v) for v in row)) for row in grid.tolist()]
        return PreparedBatch(modality=modality, layouts=layouts, inputs={"pixel_values": pixels, "grid_thw": grid})

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = batch.inputs["pixel_values"].to(device=self.device, dtype=self.dtype, non_blocking=True)
        grid = batch.inputs["grid_thw"].to(self.device)
        rows = self.run_tower(self.tower, pixels, grid, batch.modality)
        return rows.to("cpu").contiguous()
