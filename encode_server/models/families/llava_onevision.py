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

from pathlib import Path
from typing import Any

import torch

from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part
from processors.base import PreparedBatch
from processors.families.llava_onevision import LlavaOnevisionProcessor, PlaceholderCounter
from processors.vision_part import init_default, processor_settings


class LlavaOnevisionAdapter(VisionPartAdapter):
    """Runs `LlavaOnevisionModel.get_image_features` (vision part only) on anyres-tiled images."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, processor: LlavaOnevisionProcessor,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "llava_onevision", model, config.text_config.hidden_size, processor, device, dtype)

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
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor as Full

    config = AutoConfig.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    settings = processor_settings(folder)
    aspect_ratio = settings.get("vision_aspect_ratio",
                                init_default(Full.__init__, "vision_aspect_ratio"))
    strategy = settings.get("vision_feature_select_strategy")
    check_consistent(config, image_processor, settings, aspect_ratio, strategy)
    counter = PlaceholderCounter(image_processor, num_image_tokens(config, settings), aspect_ratio, strategy)
    processor = LlavaOnevisionProcessor(image_processor, counter, [list(p) for p in config.image_grid_pinpoints],
                                        int(config.vision_config.image_size), int(config.vision_config.patch_size))
    model = load_vision_part(folder, LlavaOnevisionModel, config, device, dtype)
    return LlavaOnevisionAdapter(folder.name, model, config, processor, device, dtype)


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
