"""Any other `transformers` multimodal model, served exactly through its own forward, or refused at start-up
naming why.

A folder whose `model_type` no dedicated family claims is served by running the model's own code up to the
point where its language model would start:

- **The model** is the class the checkpoint was saved from (`config.json`'s `architectures`, else the
  image-text-to-text / multimodal-LM class `transformers` registers for the `model_type`), built on the
  meta device. Its language model (the submodule that receives `inputs_embeds`: `language_model`,
  `text_model`, or a thinker's text model; for a model whose decoder layers sit beside its multimodal
  embedder, the first decoder layer) is replaced by a *trap* that takes the `inputs_embeds` it is called
  with and stops the forward; its embedding table by a stand-in that gives zeros
  (`generic/language_model_trap.py`). Only the remaining modules' tensors are read, loaded through
  `transformers`' own key conversions (`vision_parts.load_model_part`).
- **An item** (an image, an audio clip at the feature extractor's rate, or a video's frames as the server
  sampled them, with their source frame rate and indices) goes through the folder's full
  processor alone, in a prompt holding the modality's placeholder (the chat template's, which writes any
  framing the processor expects, else the processor's own token, else that token between the start and end
  tokens the processor names, for a processor that refuses a bare one; for a processor that takes media only
  through its chat request, as Voxtral's, the item alone in a user message, `processors/chat_request.py`).
  The model's forward runs on the result until the trap; the rows are `inputs_embeds` at the positions of
  the tokens the model fills, in order: what the language model receives there. The item's row count is the
  number of those tokens the full processor inserted, counted by running the processor (cached per image size
  or clip length): the prefill side runs the same processor.
- **Which tokens the model fills is measured at start-up, never assumed** (`generic/probes.py`). Probe
  items of several sizes run with text embeddings of zeros and of a fixed pattern, and again with other content of
  the same size. A token is a placeholder if the rows at its positions change with the item; they must not change
  with the text embedding. Framing the model embeds itself (constant rows) is not counted. Refused, naming why: a
  modality whose probes carry no features, rows that mix features with the text embedding (the server does not
  hold the language model's table), a processor that does not load (e.g. it needs torchvision),
  a model without multimodal inputs.

A modality that fails its probes is left out (the log says why); a model with none left is refused.
Items whose processed inputs have the same shapes run as one forward where the start-up probe showed
that gives each item's rows alone (`joins_exactly`); others run one at a time. `collate` just joins
per-item inputs. `grid_thw` is `[1, 1, rows]`. No tensor-parallel plan.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.family import Family
from encode_server.models.generic.language_model_trap import (
    Captured,
    TextEmbedding,
    build_on_meta,
    build_trapped,
    model_class_of,
)
from encode_server.models.generic.probes import PlaceholderProbes, first_line
from encode_server.models.loading.checkpoint import CheckpointError, read_config
from encode_server.models.towers.vision_parts import load_model_part
from processors.base import ItemLayout, PreparedBatch
from processors.families.generic import GenericProcessor
from processors.joined_inputs import joinable_runs, joined_inputs


def full_processor(folder: Path, model_type: str) -> Any:
    """The folder's full processor, or a refusal naming why it cannot count placeholder tokens."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 (any failure to build it is a reason to refuse, named in the message)
        raise CheckpointError(f"{folder}: model_type {model_type!r}: its full processor does not load here "
                              f"({first_line(exc)}), so placeholder tokens cannot be counted") from None


class GenericAdapter(PlaceholderProbes, EncoderAdapter):
    """Runs a model's own forward up to its language model on one item at a time, counted by its processor."""

    processor: GenericProcessor

    def __init__(self, name: str, model_type: str, model: torch.nn.Module, embedding: TextEmbedding,
                 full: Any, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model.to(device=device).eval()
        self.embedding = embedding
        self.device = device
        self.dtype = dtype
        self.model_type = model_type
        self.name = name
        self.hidden_size = int(hidden_size)
        self.batchable: dict[str, bool] = {}  # modality -> whether items whose inputs join run as one forward
        parameters = inspect.signature(model.forward).parameters
        self.forward_inputs = {key for key, p in parameters.items()
                               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.processor = GenericProcessor(name, full, self.forward_inputs)
        self.info = ModelInfo(name=name, family=model_type, modalities=(), hidden_size=self.hidden_size)

    # --- the model's forward up to the trap -----------------------------------------------------------

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                return value.to(device=self.device, dtype=self.dtype)
            return value.to(device=self.device)
        if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._to_device(v) for v in value)
        return value

    @torch.inference_mode()
    def language_model_inputs(self, inputs: dict[str, Any]) -> torch.Tensor:
        """`inputs_embeds` `[prompts, positions, hidden]` as the language model would receive them."""
        kwargs = {key: self._to_device(value) for key, value in inputs.items() if key in self.forward_inputs}
        if "use_cache" in self.forward_inputs:
            kwargs["use_cache"] = False
        try:
            self.model(**kwargs)
        except Captured as captured:
            return captured.embeds
        raise RuntimeError("the model's forward returned without calling its language model")

    def _rows(self, modality: str, embeds: torch.Tensor, input_ids: torch.Tensor, layout: ItemLayout) -> torch.Tensor:
        rows = embeds[self.processor.positions(modality, input_ids).to(embeds.device)]
        if rows.shape[0] != layout.tokens:
            raise RuntimeError(f"{self.name}: {rows.shape[0]} rows for an item counted {layout.tokens}")
        return rows.to("cpu")

    @torch.inference_mode()
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """Items whose processed inputs join (same shapes) run as one forward where the start-up probe showed
        that gives their rows alone; the others one at a time."""
        items = list(zip(batch.extras["items"], batch.layouts))
        parts = []
        for group in (joinable_runs(items) if self.batchable.get(batch.modality) else [[item] for item in items]):
            inputs = group[0][0] if len(group) == 1 else joined_inputs([inputs for inputs, _ in group])
            embeds = self.language_model_inputs(inputs)
            parts.extend(self._rows(batch.modality, embeds[index], item_inputs["input_ids"], layout)
                         for index, (item_inputs, layout) in enumerate(group))
        return torch.cat(parts).contiguous()


def text_hidden_size(config: Any) -> int:
    for candidate in (getattr(config, "text_config", None), getattr(getattr(config, "thinker_config", None),
                                                                    "text_config", None), config):
        size = getattr(candidate, "hidden_size", None)
        if isinstance(size, int):
            return size
    raise CheckpointError(f"model_type {config.model_type!r}: the config names no text hidden size")


def generic_from_folder(folder: Path, device: torch.device, dtype: torch.dtype) -> GenericAdapter:
    """Serve a folder no dedicated family claims, if its rows can be counted exactly (else CheckpointError)."""
    from transformers import AutoConfig

    model_type = read_config(folder).get("model_type")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not known to transformers ({exc})") from None
    model_class = model_class_of(folder, config, model_type)
    processor = full_processor(folder, model_type)
    hidden_size = text_hidden_size(config)
    try:
        model, embedding = build_trapped(model_class, config, dtype, hidden_size)
    except CheckpointError as exc:
        raise CheckpointError(f"{folder}: model_type {model_type!r}: {exc}") from None
    model = load_model_part(folder, model, device)
    adapter = GenericAdapter(folder.name, model_type, model, embedding, processor, hidden_size, device, dtype)
    adapter.probe(folder, lambda: build_on_meta(model_class, config, dtype))
    return adapter


FAMILY = Family(
    name="generic",
    model_types=(),  # the fallback for any model_type no other family declares (`registry.py`)
    modalities=("image", "audio", "video"),
    row_formula="the placeholder tokens the full processor inserts that the model fills (measured at start-up); "
                "refused if they cannot be told apart",
    grid_thw="`[1, 1, rows]`",
    load=generic_from_folder,
)
