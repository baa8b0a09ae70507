"""Any other `transformers` image-text model whose rows can be counted exactly, or a start-up refusal saying why not.

A folder whose `model_type` no dedicated family claims is served here when all of these hold:

1. `transformers` has a base model class for the `model_type` and it exposes `get_image_features`;
2. that class has a `language_model` submodule, so its vision part can be built without it
   (`processors/vision_parts.py`);
3. the folder's full processor loads here (`AutoProcessor.from_pretrained(folder)`, tokenizer
   included; processors that need torchvision cannot) and implements `_get_num_multimodal_tokens`
   (how many placeholder tokens an image gets, from its size alone);
4. the config names the token the model splices rows into (`image_token_id`);
5. on a few probe images of different shapes, three counts agree: `_get_num_multimodal_tokens`, the
   number of `image_token_id` tokens the full processor really inserts into `input_ids`, and the rows
   `get_image_features` returns.

Anything else is refused at start-up with the first failing condition named. Serving stays exact
per item: `preprocess` runs the full processor on each item alone (the prompt is the processor's
image token) and takes the item's row count from the placeholder tokens it inserted; `forward` runs
`get_image_features` on each item alone and refuses rows that do not match that count. Items are
thus never padded or batched together (correctness over speed; a dedicated family module can fuse),
and `collate` just joins per-item inputs. The rows are `get_image_features(...).pooler_output`,
flattened in order: what the model's own `forward` splices at the placeholder positions.
`grid_thw` is `[1, 1, tokens]` (no grid is known for a generic model). No tensor-parallel plan.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .base import ItemError, ItemLayout, PreparedBatch
from .checkpoint import CheckpointError, read_config
from .family import Family
from .vision_parts import VisionPartAdapter, as_images, base_model_class, load_vision_part

PROBE_SIZES = ((48, 64), (160, 48), (90, 200))  # (height, width) of the start-up agreement check
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


class GenericAdapter(VisionPartAdapter):
    """Runs a model's own `get_image_features` on one item at a time, counted by its full processor."""

    def __init__(self, name: str, model_type: str, model: torch.nn.Module, config: Any, processor: Any,
                 image_token_id: int, device: torch.device, dtype: torch.dtype) -> None:
        text = getattr(config, "text_config", config)
        super().__init__(name, model_type, model, text.hidden_size, device, dtype)
        self.processor = processor
        self.image_token_id = int(image_token_id)
        parameters = inspect.signature(model.get_image_features).parameters
        self.feature_inputs = {name for name, p in parameters.items()
                               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def expected_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens for an image of this size, by the processor's `_get_num_multimodal_tokens`."""
        counts = self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
        return int(counts["num_image_tokens"][0])

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        (image,) = as_images([item])
        width, height = image.size
        tokens = self.expected_tokens(height, width)
        return ItemLayout(tokens=tokens, grid_thw=(1, 1, tokens))

    def _prepare_one(self, image: Image.Image) -> tuple[dict[str, torch.Tensor], ItemLayout]:
        processed = self.processor(text=[self.processor.image_token], images=[image], return_tensors="pt")
        tokens = int((processed["input_ids"] == self.image_token_id).sum())
        inputs = {key: value for key, value in processed.items()
                  if key not in TEXT_INPUTS and key in self.feature_inputs and isinstance(value, torch.Tensor)}
        return inputs, ItemLayout(tokens=tokens, grid_thw=(1, 1, tokens))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        prepared = [self._prepare_one(image) for image in as_images(items)]
        for index, (image, (_, layout)) in enumerate(zip(items, prepared)):
            formula = self.expected_tokens(image.size[1], image.size[0])
            if layout.tokens != formula:
                raise ItemError(f"item {index}: the processor inserts {layout.tokens} image tokens for a "
                                f"{image.size[0]}x{image.size[1]} image but says {formula}; refusing rows "
                                "that cannot be counted")
        return PreparedBatch(modality=modality, inputs={}, layouts=[layout for _, layout in prepared],
                             extras={"items": [inputs for inputs, _ in prepared]})

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Per-item batches joined in order (generic items are never padded together)."""
        return PreparedBatch(modality=batches[0].modality, inputs={},
                             layouts=[layout for batch in batches for layout in batch.layouts],
                             extras={"items": [inputs for batch in batches for inputs in batch.extras["items"]]})

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        parts = []
        for inputs, layout in zip(batch.extras["items"], batch.layouts):
            features = self.model.get_image_features(**{k: self.to_device(v) for k, v in inputs.items()},
                                                     return_dict=True)
            rows = self.flat_rows(features.pooler_output)
            if rows.shape[0] != layout.tokens:
                raise RuntimeError(f"{self.info.family}: get_image_features gave {rows.shape[0]} rows for an item "
                                   f"the processor gives {layout.tokens} placeholder tokens")
            parts.append(rows)
        return torch.cat(parts)

    def verify_counts(self, folder: Path) -> None:
        """Refuse to serve unless formula, processor and model agree on probe images of several shapes."""
        for height, width in PROBE_SIZES:
            image = Image.fromarray(np.full((height, width, 3), 127, dtype=np.uint8))
            formula = self.expected_tokens(height, width)
            inputs, layout = self._prepare_one(image)
            batch = PreparedBatch("image", {}, [layout], {"items": [inputs]})
            try:
                rows = self.forward(batch)
            except RuntimeError as exc:
                raise CheckpointError(f"{folder}: {exc} (probe {width}x{height}); its rows cannot be counted "
                                      "exactly") from None
            if not formula == layout.tokens == rows.shape[0]:
                raise CheckpointError(
                    f"{folder}: for a {width}x{height} image, _get_num_multimodal_tokens says {formula}, the "
                    f"processor inserts {layout.tokens} image tokens and get_image_features gives {rows.shape[0]} "
                    "rows; its rows cannot be counted exactly")
            if rows.shape[1] != self.info.hidden_size:
                raise CheckpointError(f"{folder}: rows are {rows.shape[1]} wide, not the text hidden size "
                                      f"{self.info.hidden_size}")


def full_processor(folder: Path, model_type: str) -> Any:
    """The folder's full processor, or a refusal naming why it cannot count placeholder tokens."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 (any failure to build it is a reason to refuse, named in the message)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{folder}: model_type {model_type!r}: its full processor does not load here "
                              f"({type(exc).__name__}: {first_line}), so image tokens cannot be counted") from None
    if not hasattr(processor, "_get_num_multimodal_tokens"):
        raise CheckpointError(f"{folder}: model_type {model_type!r}: its processor {type(processor).__name__} has "
                              "no _get_num_multimodal_tokens, so an image's token count is unknown")
    if getattr(processor, "image_processor", None) is None or not getattr(processor, "image_token", None):
        raise CheckpointError(f"{folder}: model_type {model_type!r}: its processor {type(processor).__name__} has "
                              "no image processor or image token")
    return processor


def generic_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> GenericAdapter:
    """Serve a folder no dedicated family claims, if its rows can be counted exactly (else CheckpointError)."""
    from transformers import AutoConfig

    model_type = read_config(folder).get("model_type")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not known to transformers ({exc})") from None
    model_class = base_model_class(model_type)
    if not callable(getattr(model_class, "get_image_features", None)):
        raise CheckpointError(f"{folder}: model_type {model_type!r}: {model_class.__name__} has no "
                              "get_image_features, so there are no image rows to serve")
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None:
        raise CheckpointError(f"{folder}: model_type {model_type!r}: the config names no image_token_id to splice "
                              "rows into")
    processor = full_processor(folder, model_type)
    model = load_vision_part(folder, model_class, config, device, dtype)
    adapter = GenericAdapter(folder.name, model_type, model, config, processor, image_token_id, device, dtype)
    adapter.verify_counts(folder)
    return adapter


FAMILY = Family(
    name="generic",
    model_types=(),  # the fallback for any model_type no other family declares (processors/registry.py)
    modalities=("image",),
    row_formula="the processor's `_get_num_multimodal_tokens`, checked at start-up against the tokens it inserts "
                "and the rows; refused if they disagree",
    grid_thw="`[1, 1, rows]`",
    load=generic_from_folder,
)
