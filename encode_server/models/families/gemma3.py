"""Gemma 3 (`model_type` "gemma3"): SigLIP tower + average-pool projector, a fixed token count per image.

Every image the processor emits becomes `mm_tokens_per_image` rows (`Gemma3Model.get_image_features`:
SigLIP, average pooling to a `k x k` grid, RMS norm, projection). With pan-and-scan the processor
emits the image *and* its crops, and the full processor's prompt gets one
`<start_of_image>` + `mm_tokens_per_image` x `<image_soft_token>` + `<end_of_image>` block for each of
them; so an item's rows are `mm_tokens_per_image * (1 + crops)`, in that order (image first, then
the crops), exactly the placeholder tokens the prefill side's processor inserts.

Which settings the full processor really uses (read in `transformers` 5.23): `Gemma3Processor`
passes its own `images_kwargs` (`do_pan_and_scan=False`, `pan_and_scan_min_crop_size=256`, ...) to
the image processor on every call, and these override the pan-and-scan values of the folder's image
processor config. So pan-and-scan is on only when the caller asks for it at call time (vLLM's
`mm_processor_kwargs`). The adapter resolves its settings the same way: the image processor from
the folder, then the processor's `images_kwargs`, then `processor_kwargs` given to the loader (the
same call-time kwargs the prefill side passes its processor). `grid_thw` is `[1 + crops, k, k]`
with `k * k = mm_tokens_per_image`. Image only. Tensor parallel: the SigLIP blocks are sharded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.towers.vision_parts import VisionPartAdapter, load_vision_part
from processors.base import PreparedBatch
from processors.families.gemma3 import PAN_AND_SCAN_KEYS, Gemma3Processor
from processors.vision_part import init_default, processor_settings


class Gemma3Adapter(VisionPartAdapter):
    """Runs `Gemma3Model.get_image_features` (vision part only) on images and their pan-and-scan crops."""

    def __init__(self, name: str, model: torch.nn.Module, config: Any, processor: Gemma3Processor,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(name, "gemma3", model, config.text_config.hidden_size, processor, device, dtype)

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        pixels = self.to_device(batch.inputs["pixel_values"])
        return self.flat_rows(self.model.get_image_features(pixel_values=pixels).pooler_output)


def check_consistent(config: Any, image_seq_length: int, image_processor: Any) -> None:
    """Refuse a folder whose processor and model disagree on the rows of an image (prefill would fail)."""
    vision = config.vision_config
    patches = int(vision.image_size) // int(vision.patch_size)
    side = int(int(config.mm_tokens_per_image) ** 0.5)
    if side * side != config.mm_tokens_per_image or patches % side:
        raise CheckpointError(f"gemma3: mm_tokens_per_image={config.mm_tokens_per_image} is not a k*k grid that "
                              f"divides the tower's {patches}x{patches} patches")
    if image_seq_length != config.mm_tokens_per_image:
        raise CheckpointError(f"gemma3: the processor inserts image_seq_length={image_seq_length} tokens per image "
                              f"but the model yields mm_tokens_per_image={config.mm_tokens_per_image} rows")
    size = image_processor.size
    if (int(size.height), int(size.width)) != (int(vision.image_size),) * 2:
        raise CheckpointError(f"gemma3: the image processor resizes to {size.height}x{size.width} but the tower "
                              f"takes {vision.image_size}x{vision.image_size}")


def gemma3_from_folder(folder: Path, device: torch.device, dtype: torch.dtype,
                       processor_kwargs: Mapping[str, Any] | None = None) -> Gemma3Adapter:
    """The vision part of a Gemma 3 checkpoint; `processor_kwargs` are call-time processor kwargs, as on prefill."""
    from transformers import AutoConfig, AutoImageProcessor, Gemma3Model
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor as FullProcessor

    config = AutoConfig.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    settings = processor_settings(folder)
    image_seq_length = int(settings.get("image_seq_length", init_default(FullProcessor.__init__,
                                                                         "image_seq_length")))
    check_consistent(config, image_seq_length, image_processor)
    unknown = set(processor_kwargs or {}) - set(PAN_AND_SCAN_KEYS) - {"do_convert_rgb"}
    if unknown:
        raise CheckpointError(f"gemma3: unsupported processor kwargs {sorted(unknown)}")
    # The full processor's precedence: image processor config < processor images_kwargs < call kwargs.
    images_kwargs = {**FullProcessor.images_kwargs, **(processor_kwargs or {})}
    model = load_vision_part(folder, Gemma3Model, config, device, dtype)
    processor = Gemma3Processor(image_processor, images_kwargs, int(config.mm_tokens_per_image))
    return Gemma3Adapter(folder.name, model, config, processor, device, dtype)


def shard_gemma3(adapter: Any, mesh: Any) -> None:
    """Shard the SigLIP blocks (heads column-wise, MLP hidden column-wise, outputs row-wise)."""
    from encode_server.models.sharding.clip_towers import shard_clip_like_encoder

    shard_clip_like_encoder(adapter.model.vision_tower, mesh, "gemma3")


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    modalities=("image",),
    row_formula="`mm_tokens_per_image * (1 + crops)`; pan-and-scan crops only when the processor is called with it",
    grid_thw="`[1 + crops, k, k]`, `k*k = mm_tokens_per_image`",
    load=gemma3_from_folder,
    shard=shard_gemma3,
)
