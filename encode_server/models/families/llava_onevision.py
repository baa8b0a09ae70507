"""LLaVA-OneVision (`model_type` "llava_onevision"): anyres tiles plus the base image, unpadded, with newline rows.

The image processor (PIL backend) picks the best grid from `image_grid_pinpoints` for the image's
size, cuts the resized and padded image into tiles of the tower's input size, and puts a resized
copy of the whole image first (the base tile). `LlavaOnevisionModel.get_image_features` runs every
tile through the tower and projector, then packs them: the base tile's rows, followed by the tiles'
feature map stitched together, cropped to the image's aspect ratio (unpadding), bilinearly shrunk if
it exceeds `anyres_max_N` tiles, with one `image_newline` row closing each row of the map. The
adapter calls that method itself, so the rows are the model's own.

The row count is the prefill side's placeholder count, computed with the full processor's own code
(`LlavaOnevisionProcessor._get_number_of_features`, minus one for the "default" feature strategy)
from the processor settings in the folder (`processor_config.json`: `num_image_tokens`, derived from
the tower when absent; `vision_aspect_ratio` and `vision_feature_select_strategy`, refused when they
contradict the model's config, as are tiles or grid pinpoints that differ from the model's).
That is the count for a prompt holding one image (the processor's single-image mode, the one
`_get_num_multimodal_tokens` and vLLM use); transformers' processor gives each image of a
*multi-image* prompt only its base tile plus one newline row, a layout this encoder does not produce.
Tiles run through the tower one by one, so fused items never change each other's rows; the batch's
tiles are concatenated (`[tiles, 3, S, S]`, the 4-D input `get_image_features` accepts) rather than
padded per item, so per-item inputs concatenate as they are.

`grid_thw` is `[tiles, p, p]`: the tile count with the base tile, and the tower's patch grid per tile.
Video is not served: `LlavaOnevisionVideoProcessor` needs torchvision, which is absent. Tensor
parallel: the SigLIP/CLIP blocks are sharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ItemLayout, PreparedBatch
from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import (
    VisionPartAdapter,
    as_images,
    init_default,
    load_vision_part,
    processor_settings,
)


def placeholder_counter(image_processor: Any, num_image_tokens: int, vision_aspect_ratio: str,
                        vision_feature_select_strategy: str | None) -> Any:
    """The full processor's image-token count, with its own methods, without building it (its video half needs
    torchvision)."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    class PlaceholderCounter:
        _get_number_of_features = LlavaOnevisionProcessor._get_number_of_features
        _get_unpadded_features = LlavaOnevisionProcessor._get_unpadded_features

        def __init__(self) -> None:
            self.image_processor = image_processor
            self.num_image_tokens = num_image_tokens
            self.vision_aspect_ratio = vision_aspect_ratio
            size = image_processor.size
            self.tile = (int(size.height), int(size.width)) if size.height else (int(size.shortest_edge),) * 2

        def __call__(self, height: int, width: int) -> int:
            # As `replace_image_token` in single-image mode: the processed tile size is the processor's `size`.
            count = self._get_number_of_features(height, width, *self.tile)
            return count - 1 if vision_feature_select_strategy == "default" else count

    return PlaceholderCounter()


class LlavaOnevisionAdapter(VisionPartAdapter):
    """Runs `LlavaOnevisionModel.get_image_features` (vision part only) on anyres-tiled images."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, image_processor: Any, counter: Any,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "llava_onevision", model, config.text_config.hidden_size, device, dtype)
        self.image_processor = image_processor
        self.count_placeholders = counter
        self.grid_pinpoints = [list(p) for p in config.image_grid_pinpoints]
        self.tile_size = int(config.vision_config.image_size)
        self.patch_grid = self.tile_size // int(config.vision_config.patch_size)

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

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        features = self.model.get_image_features(pixel_values=self.to_device(batch.inputs["pixel_values"]),
                                                 image_sizes=self.to_device(batch.inputs["image_sizes"]))
        return self.flat_rows(features.pooler_output)


def check_consistent(config: Any, image_processor: Any, settings: dict[str, Any], aspect_ratio: str,
                     strategy: str | None) -> None:
    """Refuse a folder whose processor and model would disagree on an image's tiles or rows."""
    vision = config.vision_config
    size = image_processor.size
    tile = int(size.height) if size.height else int(size.shortest_edge)
    if tile != int(vision.image_size) or (size.height and int(size.width) != tile):
        raise CheckpointError(f"llava_onevision: the image processor's tiles ({size}) are not the tower's "
                              f"{vision.image_size}x{vision.image_size} input")
    if [list(p) for p in image_processor.image_grid_pinpoints] != [list(p) for p in config.image_grid_pinpoints]:
        raise CheckpointError("llava_onevision: the image processor's image_grid_pinpoints differ from the model's")
    if aspect_ratio != config.vision_aspect_ratio:
        raise CheckpointError(f"llava_onevision: the processor's vision_aspect_ratio {aspect_ratio!r} differs from "
                              f"the model's {config.vision_aspect_ratio!r}")
    if (strategy == "default") != (config.vision_feature_select_strategy == "default"):
        raise CheckpointError(f"llava_onevision: the processor's vision_feature_select_strategy {strategy!r} differs "
                              f"from the model's {config.vision_feature_select_strategy!r}")


def num_image_tokens(config: Any, settings: dict[str, Any]) -> int:
    """The processor's `num_image_tokens` (tokens of one tile, class token included when "default" drops it).

    A folder without it leaves `LlavaOnevisionProcessor` unable to count at all; the value it would need
    follows from the tower (`(image_size // patch_size)^2`, plus the class token "default" drops).
    """
    if settings.get("num_image_tokens") is not None:
        return int(settings["num_image_tokens"])
    vision = config.vision_config
    patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
    return patches + (1 if config.vision_feature_select_strategy == "default" else 0)


def llava_onevision_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> LlavaOnevisionAdapter:
    """The vision part (tower, projector, `image_newline`) of a LLaVA-OneVision checkpoint."""
    from transformers import AutoConfig, AutoImageProcessor, LlavaOnevisionModel
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    config = AutoConfig.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    settings = processor_settings(folder)
    aspect_ratio = settings.get("vision_aspect_ratio",
                                init_default(LlavaOnevisionProcessor.__init__, "vision_aspect_ratio"))
    strategy = settings.get("vision_feature_select_strategy")
    check_consistent(config, image_processor, settings, aspect_ratio, strategy)
    counter = placeholder_counter(image_processor, num_image_tokens(config, settings), aspect_ratio, strategy)
    model = load_vision_part(folder, LlavaOnevisionModel, config, device, dtype)
    return LlavaOnevisionAdapter(folder.name, model, config, image_processor, counter, device, dtype)


def shard_llava_onevision(adapter: Any, mesh: Any) -> None:
    """Shard the SigLIP/CLIP blocks (heads column-wise, MLP hidden column-wise, outputs row-wise)."""
    from encode_server.models.sharding.clip_towers import shard_clip_like_encoder

    shard_clip_like_encoder(adapter.model.vision_tower, mesh, "llava_onevision")


FAMILY = Family(
    name="llava_onevision",
    model_types=("llava_onevision",),
    modalities=("image",),
    row_formula="base tile + unpadded tile map (shrunk past `anyres_max_N`) + one newline per map row, as "
                "`LlavaOnevisionProcessor` counts a one-image prompt (video: no, it needs torchvision)",
    grid_thw="`[tiles (base tile included), p, p]`, `p x p` = one tile's patch grid",
    load=llava_onevision_from_folder,
    shard=shard_llava_onevision,
)
