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
  (`processors/language_model_trap.py`). Only the remaining modules' tensors are read, loaded through
  `transformers`' own key conversions (`vision_parts.load_model_part`).
- **An item** (an image, an audio clip at the feature extractor's rate, or a video's frames as the server
  sampled them, with their source frame rate and indices) goes through the folder's full
  processor alone, in a prompt holding the modality's placeholder (the chat template's, which writes any
  framing the processor expects, else the processor's own token). The model's forward runs on the result
  until the trap; the rows are `inputs_embeds` at the positions of the tokens the model fills, in order:
  what the language model receives there. The item's row count is the number of those tokens the full
  processor inserted, counted by running the processor (cached per image size or clip length): the
  prefill side runs the same processor.
- **Which tokens the model fills is measured at start-up, never assumed.** Probe items of several sizes run
  with text embeddings of zeros and of a fixed pattern, and again with other content of the same size. A
  token is a placeholder if the rows at its positions change with the item; they must not change with the
  text embedding. Framing the model embeds itself (constant rows) is not counted. Refused, naming why:
  a modality whose probes carry no features, rows that mix features with the text embedding (the server
  does not hold the language model's table), a processor that does not load (e.g. it needs torchvision),
  a model without multimodal inputs.

A modality that fails its probes is left out (the log says why); a model with none left is refused.
Items whose processed inputs have the same shapes run as one forward where the start-up probe showed
that gives each item's rows alone (`joins_exactly`); others run one at a time. `collate` just joins
per-item inputs. `grid_thw` is `[1, 1, rows]`. No tensor-parallel plan.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .base import EncoderAdapter, ItemError, ItemLayout, ModelInfo, PreparedBatch
from .checkpoint import CheckpointError, read_config
from .family import Family
from .language_model_trap import Captured, TextEmbedding, build_trapped, model_class_of
from .torchvision_processors import clip_tensor
from .video_clip import VideoClip
from .vision_parts import load_model_part

log = logging.getLogger("encode_server.processors.generic")

PROBE_IMAGES = ((72, 96), (200, 120), (130, 260))  # (height, width) of the start-up probes
PROBE_AUDIO_SECONDS = (1.3, 3.1)
PROBE_CLIPS = ((4, 72, 96), (8, 120, 80))  # (frames, height, width)
PROBE_CLIP_FPS = 2.0
LAYOUT_CACHE_SIZE = 4096
MODALITY_PROCESSORS = {"image": ("image_processor",), "audio": ("feature_extractor", "audio_processor"),
                       "video": ("video_processor",)}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def full_processor(folder: Path, model_type: str) -> Any:
    """The folder's full processor, or a refusal naming why it cannot count placeholder tokens."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 (any failure to build it is a reason to refuse, named in the message)
        raise CheckpointError(f"{folder}: model_type {model_type!r}: its full processor does not load here "
                              f"({first_line(exc)}), so placeholder tokens cannot be counted") from None


def placeholder_prompts(processor: Any, modality: str) -> list[str]:
    """Prompts holding one placeholder: the chat template's (with the framing it writes), then the bare token;
    last an empty text, for processors that insert the placeholders themselves."""
    prompts = []
    if getattr(processor, "chat_template", None):
        try:
            prompts.append(processor.apply_chat_template(
                [{"role": "user", "content": [{"type": modality}]}], tokenize=False, add_generation_prompt=False))
        except Exception:  # noqa: BLE001 (a template that cannot render a bare item: try the token alone)
            pass
    tokenizer = getattr(processor, "tokenizer", None)
    for source in (processor, tokenizer):
        for name in (f"{modality}_token", f"{modality}_placeholder_token"):  # the latter: what a prompt holds
            token = getattr(source, name, None)
            token = getattr(token, "content", token)  # an AddedToken
            if isinstance(token, str) and token and token not in prompts:
                prompts.append(token)
    prompts.append("")  # processors that insert the placeholders themselves (e.g. before the text)
    return prompts


class GenericAdapter(EncoderAdapter):
    """Runs a model's own forward up to its language model on one item at a time, counted by its processor."""

    def __init__(self, name: str, model_type: str, model: torch.nn.Module, embedding: TextEmbedding,
                 processor: Any, hidden_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model.to(device=device).eval()
        self.embedding = embedding
        self.processor = processor
        self.device = device
        self.dtype = dtype
        self.model_type = model_type
        self.name = name
        self.hidden_size = int(hidden_size)
        self.prompts: dict[str, str] = {}  # modality -> the prompt its probes passed with
        self.filled: dict[str, torch.Tensor] = {}  # modality -> the token ids the model fills
        self.batchable: dict[str, bool] = {}  # modality -> whether items whose inputs join run as one forward
        self.layouts: OrderedDict[tuple, ItemLayout] = OrderedDict()
        self._last_processed: tuple[Any, dict[str, Any]] | None = None
        parameters = inspect.signature(model.forward).parameters
        self.forward_inputs = {key for key, p in parameters.items()
                               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        extractor = self._part("audio")
        self.sampling_rate = int(getattr(extractor, "sampling_rate", 16000) or 16000)
        self.info = ModelInfo(name=name, family=model_type, modalities=(), hidden_size=self.hidden_size)

    def _part(self, modality: str) -> Any:
        for attribute in MODALITY_PROCESSORS[modality]:
            part = getattr(self.processor, attribute, None)
            if part is not None:
                return part
        return None

    # --- items through the processor -------------------------------------------------------------------

    def _check_item(self, modality: str, item: Any, index: int = 0) -> None:
        if modality == "image" and not isinstance(item, Image.Image):
            raise ItemError(f"item {index}: expected an image, got {type(item).__name__}")
        if modality == "audio" and not (isinstance(item, np.ndarray) and item.ndim == 1):
            raise ItemError(f"item {index}: expected a mono waveform, got {type(item).__name__}")
        if modality == "video" and not (isinstance(item, list) and item
                                        and all(isinstance(frame, Image.Image) for frame in item)):
            raise ItemError(f"item {index}: expected a video's frames, got {type(item).__name__}")

    def _process(self, modality: str, item: Any, prompt: str) -> dict[str, Any]:
        if modality == "image":
            media = {"images": [item]}
        elif modality == "video":  # the frames as the server sampled them, with where they come from
            from transformers.video_utils import VideoMetadata

            fps = getattr(item, "fps", PROBE_CLIP_FPS)
            indices = list(getattr(item, "frames_indices", range(len(item))))
            media = {"videos": [clip_tensor(item)], "do_sample_frames": False, "return_metadata": True,
                     "video_metadata": [VideoMetadata(
                total_num_frames=len(item), fps=fps, frames_indices=indices, duration=len(item) / fps)]}
        else:
            media = {"audio": [item], "sampling_rate": self.sampling_rate}
        if "mm_token_type_ids" in self.forward_inputs:  # the multimodal RoPE of some models reads it
            media["return_mm_token_type_ids"] = True
        processed = self.processor(text=[prompt], **media, return_tensors="pt")
        return {key: value for key, value in processed.items()
                if key in self.forward_inputs or key.endswith("input_ids")}

    def _positions(self, modality: str, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.isin(input_ids[0], self.filled[modality]).nonzero().flatten()

    def _layout_key(self, modality: str, item: Any) -> tuple:
        if modality == "video":
            return (modality, len(item), item[0].size, getattr(item, "fps", None),
                    tuple(getattr(item, "frames_indices", ())))
        return (modality, item.size) if modality == "image" else (modality, int(item.shape[0]))

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality not in self.filled:
            raise ItemError(f"{self.name} does not encode {modality}")
        self._check_item(modality, item)
        key = self._layout_key(modality, item)
        layout = self.layouts.get(key)
        if layout is None:
            processed = self._process(modality, item, self.prompts[modality])
            self._last_processed = (item, processed)  # `preprocess` of this same item (next, as a rule) reuses it
            tokens = int(self._positions(modality, processed["input_ids"]).numel())
            layout = ItemLayout(tokens=tokens, grid_thw=(1, 1, tokens))
            self.layouts[key] = layout
            if len(self.layouts) > LAYOUT_CACHE_SIZE:
                self.layouts.popitem(last=False)
        return layout

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_last_processed": None}  # a worker's copy starts without another's item

    def _prepare_one(self, modality: str, item: Any) -> tuple[dict[str, Any], ItemLayout]:
        last = self._last_processed
        if last is not None and last[0] is item:
            processed = last[1]
        else:
            processed = self._process(modality, item, self.prompts[modality])
        tokens = int(self._positions(modality, processed["input_ids"]).numel())
        if tokens == 0:
            raise ItemError(f"the processor inserted no {modality} placeholder for this item")
        return processed, ItemLayout(tokens=tokens, grid_thw=(1, 1, tokens))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality not in self.filled:
            raise ItemError(f"{self.name} does not encode {modality}")
        for index, item in enumerate(items):
            self._check_item(modality, item, index)
        prepared = [self._prepare_one(modality, item) for item in items]
        return PreparedBatch(modality=modality, inputs={}, layouts=[layout for _, layout in prepared],
                             extras={"items": [inputs for inputs, _ in prepared]})

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Per-item batches joined in order (generic items are never padded together)."""
        return PreparedBatch(modality=batches[0].modality, inputs={},
                             layouts=[layout for batch in batches for layout in batch.layouts],
                             extras={"items": [inputs for batch in batches for inputs in batch.extras["items"]]})

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
        rows = embeds[self._positions(modality, input_ids).to(embeds.device)]
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

    def sample_item(self) -> tuple[str, Any]:
        modality = self.info.modalities[0]
        return modality, probe_items(modality, self.sampling_rate)[0][0]

    # --- start-up: which tokens the model fills ---------------------------------------------------------

    def _probe_run(self, inputs: dict[str, Any], pattern: bool) -> torch.Tensor:
        self.embedding.pattern = pattern
        try:
            return self.language_model_inputs(inputs)[0].to("cpu", torch.float64)
        finally:
            self.embedding.pattern = False

    def _probe_inputs(self, modality: str, item: Any, prompt: str) -> dict[str, Any]:
        try:
            inputs = self._process(modality, item, prompt)
        except Exception as exc:  # noqa: BLE001 (the processor's own code failed on this input: named)
            raise CheckpointError(f"its processor fails on a probe ({first_line(exc)})") from None
        prompt_reading = [key for key in inputs if key.endswith("input_ids") and key != "input_ids"]
        if prompt_reading:
            raise CheckpointError(f"its features depend on the prompt's text ({', '.join(prompt_reading)} reach the "
                                  "media encoder), which an encode request does not carry")
        return inputs

    def _probe_rows(self, inputs: dict[str, Any], pattern: bool) -> torch.Tensor:
        try:
            rows = self._probe_run(inputs, pattern)
        except Exception as exc:  # noqa: BLE001 (the model's own code failed on this input: named)
            raise CheckpointError(f"the model's forward fails on a probe ({first_line(exc)})") from None
        if rows.shape[-1] != self.hidden_size:
            raise CheckpointError(f"the language model's inputs are {rows.shape[-1]} wide, not the text hidden size "
                                  f"{self.hidden_size}")
        return rows

    def same_rows(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Per position: whether two runs' rows agree within the dtype's rounding (bitwise on a deterministic
        float32 CPU run; a GPU kernel may reorder sums between runs)."""
        tolerance = 0.0 if self.dtype == torch.float32 and self.device.type == "cpu" else \
            1e-5 if self.dtype == torch.float32 else 1e-2
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        return ((a - b).abs() <= tolerance * scale).all(-1)

    def filled_tokens(self, modality: str, prompt: str) -> torch.Tensor:
        """The placeholder token ids: those whose rows carry the item's features, measured on the probes (or a
        `CheckpointError` naming why none can be served).

        Each probe size runs three times: item A with text embeddings of zeros, item A with a patterned text
        embedding, and item B (same size, other content) with zeros. A position whose row is the same under
        both text embeddings holds what the model computed there; a token is a placeholder if some of its
        positions change with the item. Every position of a placeholder must be independent of the text
        embedding (else the model mixes its features into text this server does not hold); tokens the model
        fills with constants (framing embedded by the model itself) are not rows."""
        placeholders: set[int] = set()
        text_bound: set[int] = set()
        for item, other in probe_items(modality, self.sampling_rate):
            inputs = self._probe_inputs(modality, item, prompt)
            other_inputs = self._probe_inputs(modality, other, prompt)
            ids = inputs["input_ids"][0]
            if not torch.equal(ids, other_inputs["input_ids"][0]):
                raise CheckpointError("two probe items of the same size get different placeholder tokens")
            zeros, patterned = self._probe_rows(inputs, False), self._probe_rows(inputs, True)
            if not bool(self.same_rows(zeros, self._probe_rows(inputs, False)).all()):
                raise CheckpointError("its forward is not deterministic: two runs on the same item give different "
                                      "rows (the model samples noise), so no rows are the model's")
            other_zeros = self._probe_rows(other_inputs, False)
            independent = self.same_rows(zeros, patterned)
            varies = ~self.same_rows(zeros, other_zeros)
            mixed = varies & ~independent
            if bool(mixed.any()):
                raise CheckpointError(f"{int(mixed.sum())} positions (tokens {sorted(set(ids[mixed].tolist()))[:8]}) "
                                      "mix the model's features with the text embedding, which this server does "
                                      "not hold")
            placeholders.update(ids[varies].tolist())
            text_bound.update(ids[~independent].tolist())
        if not placeholders:
            raise CheckpointError(f"no token of a {modality} prompt carries the item's features")
        partly = placeholders & text_bound
        if partly:
            raise CheckpointError(f"tokens {sorted(partly)} hold features at some positions and the text embedding at "
                                  "others, so rows cannot be counted from the tokens")
        return torch.tensor(sorted(placeholders))

    def joins_exactly(self, modality: str) -> bool:
        """Whether two same-size probe items run as one forward give the rows each gives alone (within the
        dtype's rounding): then items whose inputs join are batched."""
        pair = [self._prepare_one(modality, item) for item in probe_items(modality, self.sampling_rate)[0]]
        joined = joined_inputs([inputs for inputs, _ in pair])
        if joined is None:
            return False
        try:
            embeds = self.language_model_inputs(joined)
        except Exception as exc:  # noqa: BLE001 (the model does not take them together: one at a time then)
            log.info("%s: %s items run one at a time (%s)", self.name, modality, first_line(exc))
            return False
        tolerance = 1e-5 if self.dtype == torch.float32 else 2e-2
        for index, (inputs, layout) in enumerate(pair):
            together = self._rows(modality, embeds[index], inputs["input_ids"], layout).double()
            alone = self._rows(modality, self.language_model_inputs(inputs)[0], inputs["input_ids"], layout).double()
            if (together - alone).abs().max() > tolerance * alone.abs().max():
                return False
        return True

    def probe(self, folder: Path) -> None:
        """Find, per modality the processor has, the prompt and filled tokens; keep the modalities that pass."""
        reasons = {}
        for modality in MODALITY_PROCESSORS:
            if self._part(modality) is None:
                continue
            for prompt in placeholder_prompts(self.processor, modality):
                try:
                    self.filled[modality] = self.filled_tokens(modality, prompt)
                    self.prompts[modality] = prompt
                    self.batchable[modality] = self.joins_exactly(modality)
                    break
                except CheckpointError as exc:
                    reasons.setdefault(modality, str(exc))  # the first prompt's failure: the others are fallbacks
        if not self.filled:
            why = "; ".join(f"{modality}: {reason}" for modality, reason in reasons.items()) or \
                "its processor has neither an image processor nor a feature extractor"
            raise CheckpointError(f"{folder}: model_type {self.model_type!r}: no modality can be served exactly "
                                  f"({why})")
        for modality, reason in reasons.items():
            if modality not in self.filled:
                log.warning("%s: %s is not served: %s", self.name, modality, reason)
        tokenizer = getattr(self.processor, "tokenizer", None)
        self.placeholders = {modality: [tokenizer.convert_ids_to_tokens(int(t)) if tokenizer else str(int(t))
                                        for t in ids] for modality, ids in self.filled.items()}
        self.info = ModelInfo(name=self.name, family=self.model_type, modalities=tuple(self.filled),
                              hidden_size=self.hidden_size, placeholder_tokens=self.placeholders)


def join_signature(inputs: dict[str, Any]) -> tuple | None:
    """What must match for items' inputs to join: each key's dtype and trailing dimensions (None: a value that
    is not a tensor with a first dimension, so the item runs alone)."""
    signature = []
    for key, value in sorted(inputs.items()):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        signature.append((key, value.dtype, tuple(value.shape[1:])))
    return tuple(signature)


def joined_inputs(items: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Per-item processor outputs as one batch (each tensor concatenated on its first dimension), or None where
    they do not join."""
    signature = join_signature(items[0])
    if signature is None or any(join_signature(item) != signature for item in items[1:]):
        return None
    return {key: torch.cat([item[key] for item in items]) for key in items[0]}


def joinable_runs(items: list[tuple[dict[str, Any], ItemLayout]]) -> list[list[tuple[dict[str, Any], ItemLayout]]]:
    """Consecutive items grouped while their inputs join into one batch."""
    runs: list[list[tuple[dict[str, Any], ItemLayout]]] = []
    signatures: list[tuple | None] = []
    for item in items:
        signature = join_signature(item[0])
        if runs and signature is not None and signature == signatures[-1]:
            runs[-1].append(item)
        else:
            runs.append([item])
            signatures.append(signature)
    return runs


def probe_items(modality: str, sampling_rate: int) -> list[tuple[Any, Any]]:
    """Start-up probes: pairs of images of several shapes (audio clips of several lengths, videos of several
    frame counts and sizes), the two of a pair of the same size and different content (fixed seeds)."""
    def image(seed: int, height: int, width: int) -> Image.Image:
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))

    def clip(seed: int, seconds: float) -> np.ndarray:
        return (np.random.default_rng(seed).standard_normal(int(seconds * sampling_rate)) * 0.1).astype(np.float32)

    if modality == "image":
        return [(image(seed, *size), image(seed + 100, *size)) for seed, size in enumerate(PROBE_IMAGES)]
    if modality == "video":
        return [(VideoClip([image(seed * 10 + f, h, w) for f in range(frames)], PROBE_CLIP_FPS, range(frames)),
                 VideoClip([image(seed * 10 + f + 100, h, w) for f in range(frames)], PROBE_CLIP_FPS, range(frames)))
                for seed, (frames, h, w) in enumerate(PROBE_CLIPS)]
    return [(clip(seed, seconds), clip(seed + 100, seconds)) for seed, seconds in enumerate(PROBE_AUDIO_SECONDS)]


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
    adapter.probe(folder)
    return adapter


FAMILY = Family(
    name="generic",
    model_types=(),  # the fallback for any model_type no other family declares (processors/registry.py)
    modalities=("image", "audio", "video"),
    row_formula="the placeholder tokens the full processor inserts that the model fills (measured at start-up); "
                "refused if they cannot be told apart",
    grid_thw="`[1, 1, rows]`",
    load=generic_from_folder,
)
