"""The generic path's start-up measurements: which tokens a model fills with an item's features, and whether items
run as one forward give each item's rows alone (`PlaceholderProbes`, mixed into `adapter.GenericAdapter`), with
the probe items and the prompts they run in.

Each probe size runs three times: item A with text embeddings of zeros, item A with a patterned text embedding,
and item B (same size, other content) with zeros. A token is a placeholder if the rows at its positions change
with the item; they must not change with the text embedding, unless the model adds its features onto the
placeholder's own embedding row (Molmo2): then the rows served are that row (read from the checkpoint, the one
slice of the table this server holds) plus the features, what the language model receives there. Whatever cannot
be served raises a `CheckpointError` naming why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import ModelInfo
from encode_server.models.generic.language_model_trap import embedding_rows
from encode_server.models.loading.checkpoint import CheckpointError
from processors.chat_request import CHAT_REQUEST
from processors.families.generic import MODALITY_PROCESSORS, probe_items
from processors.joined_inputs import joined_inputs

log = logging.getLogger("encode_server.models.generic")

def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def token_text(source: Any, name: str) -> str | None:
    """A processor's or tokenizer's token attribute as text (an `AddedToken`'s content), or None."""
    token = getattr(source, name, None)
    token = getattr(token, "content", token)
    return token if isinstance(token, str) and token else None


def placeholder_prompts(processor: Any, modality: str) -> list[str]:
    """Prompts holding one placeholder: the chat template's (with the framing it writes), then the bare token,
    then the token between the start and end tokens the processor names (`<image_start><image><image_end>`:
    a processor that refuses a bare placeholder expects that form where its folder ships no template); then an
    empty text, for processors that insert the placeholders themselves; last, for images and audio, the item
    alone in a chat request (`processors/chat_request.py`), for processors that take media no other way."""
    prompts = []
    tokenizer = getattr(processor, "tokenizer", None)
    if getattr(processor, "chat_template", None):
        try:
            prompts.append(processor.apply_chat_template(
                [{"role": "user", "content": [{"type": modality}]}], tokenize=False, add_generation_prompt=False))
        except Exception:  # noqa: BLE001 (a template that cannot render a bare item: try the token alone)
            pass
    framed = []
    for source in (processor, tokenizer):
        for name in (f"{modality}_token", f"{modality}_placeholder_token"):  # the latter: what a prompt holds
            token = token_text(source, name)
            if token is not None and token not in prompts:
                prompts.append(token)
            start, end = token_text(source, f"{modality}_start_token"), token_text(source, f"{modality}_end_token")
            if token is not None and start is not None and end is not None:
                framed.append(start + token + end)
    prompts.extend(prompt for prompt in dict.fromkeys(framed) if prompt not in prompts)
    prompts.append("")  # processors that insert the placeholders themselves (e.g. before the text)
    if modality in ("image", "audio") and callable(getattr(processor, "apply_chat_template", None)):
        prompts.append(CHAT_REQUEST)  # processors that take media only in a chat request (Voxtral)
    return prompts


class PlaceholderProbes:
    """The start-up probes of an adapter that runs a model's forward up to its language model. Uses the adapter's
    `processor`, `embedding` (its `pattern` switch), `language_model_inputs`, `_process`, `_prepare_one`,
    `_rows`, `_part`, `hidden_size`, `sampling_rate`, `dtype`, `device`, `name` and `model_type`; `probe` fills
    its `filled`, `prompts`, `batchable`, `placeholders` and `info`, and the embedding's `kept` rows."""

    def _probe_run(self, inputs: dict[str, Any], pattern: bool) -> torch.Tensor:
        self.embedding.pattern = pattern
        try:
            return self.language_model_inputs(inputs)[0].to("cpu", torch.float64)
        finally:
            self.embedding.pattern = False

    def _probe_inputs(self, modality: str, item: Any, prompt: str) -> dict[str, Any]:
        try:
            inputs = self.processor._process(modality, item, prompt)
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
        adds: set[int] = set()  # placeholders whose rows are the features added onto the token's own embedding
        plain: set[int] = set()  # placeholders whose rows are the features alone
        for item, other in probe_items(modality, self.processor.sampling_rate):
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
            added = mixed & self.adds_text_embedding(ids, zeros, patterned)
            if bool((mixed & ~added).any()):
                rest = mixed & ~added
                raise CheckpointError(f"{int(rest.sum())} positions (tokens {sorted(set(ids[rest].tolist()))[:8]}) "
                                      "mix the model's features with the text embedding, which this server does "
                                      "not hold")
            placeholders.update(ids[varies].tolist())
            text_bound.update(ids[~independent & ~added].tolist())
            adds.update(ids[added].tolist())
            plain.update(ids[varies & ~added].tolist())
        if not placeholders:
            raise CheckpointError(f"no token of a {modality} prompt carries the item's features")
        partly = placeholders & text_bound
        if partly:
            raise CheckpointError(f"tokens {sorted(partly)} hold features at some positions and the text embedding at "
                                  "others, so rows cannot be counted from the tokens")
        if adds & plain:
            raise CheckpointError(f"tokens {sorted(adds & plain)} get the features added onto their own embedding at "
                                  "some positions and not at others")
        self.added_tokens = sorted(adds)
        return torch.tensor(sorted(placeholders))

    def adds_text_embedding(self, ids: torch.Tensor, zeros: torch.Tensor, patterned: torch.Tensor) -> torch.Tensor:
        """Per position: whether the row under the patterned text embedding is the row under zeros plus that
        token's own pattern row, i.e. the model adds its features onto the placeholder's embedding (Molmo2),
        within the dtype's rounding."""
        pattern = self.embedding.pattern_of(ids).to(self.dtype).double()  # as the model was given it
        added = zeros.double() + pattern
        tolerance = 1e-5 if self.dtype == torch.float32 else 1e-2
        scale = max(float(added.abs().max()), 1e-30)
        return ((patterned.double() - added).abs() <= tolerance * scale).all(-1)

    def joins_exactly(self, modality: str) -> bool:
        """Whether two same-size probe items run as one forward give the rows each gives alone (within the
        dtype's rounding): then items whose inputs join are batched."""
        pair = [self.processor._prepare_one(modality, item)
                for item in probe_items(modality, self.processor.sampling_rate)[0]]
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

    def probe(self, folder: Path, whole_model: Callable[[], torch.nn.Module]) -> None:
        """Find, per modality the processor has, the prompt and filled tokens; keep the modalities that pass.
        `whole_model` builds the model with its language model on the meta device, whose conversion mapping
        finds the embedding rows a model adds its features onto."""
        reasons = {}
        added: set[int] = set()
        for modality in MODALITY_PROCESSORS:
            if self.processor._part(modality) is None:
                continue
            for prompt in placeholder_prompts(self.processor.full, modality):
                try:
                    self.processor.filled[modality] = self.filled_tokens(modality, prompt)
                    self.processor.prompts[modality] = prompt
                    added.update(self.added_tokens)
                    self.batchable[modality] = self.joins_exactly(modality)
                    break
                except CheckpointError as exc:
                    reasons.setdefault(modality, str(exc))  # the first prompt's failure: the others are fallbacks
        if not self.processor.filled:
            why = "; ".join(f"{modality}: {reason}" for modality, reason in reasons.items()) or \
                "its processor has neither an image processor nor a feature extractor"
            raise CheckpointError(f"{folder}: model_type {self.model_type!r}: no modality can be served exactly "
                                  f"({why})")
        for modality, reason in reasons.items():
            if modality not in self.processor.filled:
                log.warning("%s: %s is not served: %s", self.name, modality, reason)
        if added:  # the language model's inputs at these placeholders are their embedding rows plus the features
            rows = embedding_rows(folder, whole_model(), self.embedding.source, sorted(added))
            self.embedding.kept = {token: row.to(device=self.device, dtype=self.dtype) for token, row in rows.items()}
            log.info("%s: the rows at tokens %s include each token's own embedding row (the model adds its features "
                     "onto it)", self.name, sorted(added))
        tokenizer = getattr(self.processor.full, "tokenizer", None)
        self.placeholders = {modality: [tokenizer.convert_ids_to_tokens(int(t)) if tokenizer else str(int(t))
                                        for t in ids] for modality, ids in self.processor.filled.items()}
        self.info = ModelInfo(name=self.name, family=self.model_type, modalities=tuple(self.processor.filled),
                              hidden_size=self.hidden_size, placeholder_tokens=self.placeholders)
