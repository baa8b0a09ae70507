"""The model a generic folder is served with: its own class, stopped where its language model would start.

The class the checkpoint was saved from is built on the meta device; its language model (the submodule
that receives `inputs_embeds`: `language_model`, `text_model`, a thinker's text model; for a model whose
multimodal embedder sits beside its decoder layers, the first decoder layer) is replaced by a trap that
raises `Captured` with the `inputs_embeds` it is called with, and its embedding table by `TextEmbedding`, a
stand-in giving zeros (or, for the start-up check in `generic/adapter.py`, a fixed pattern). The LM head
is dropped, so only the media modules' tensors are loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.loading.checkpoint import CheckpointError

LANGUAGE_MODEL_NAMES = ("language_model", "text_model")


class Captured(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """Raised by a trap with the `inputs_embeds` the language model was about to receive."""

    def __init__(self, embeds: torch.Tensor) -> None:
        super().__init__("inputs_embeds captured")
        self.embeds = embeds


class TextEmbedding(torch.nn.Module):
    """In place of the language model's embedding table: zeros, or (for the start-up check) a fixed pattern
    that differs per token and per column."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.pattern = False
        #: The model key of the table this stands in for (`...embed_tokens.weight`), for `kept` rows.
        self.source = ""
        #: Token id -> its row of the real table, for the placeholders a model adds its features onto
        #: (Molmo2): the language model's inputs there are that row plus the features, so the row is served.
        self.kept: dict[int, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        shape = (*input_ids.shape, self.hidden_size)
        if not self.pattern:
            rows = torch.zeros(shape, dtype=self.dtype, device=input_ids.device)
            for token, row in self.kept.items():
                rows[input_ids == token] = row.to(device=rows.device, dtype=rows.dtype)
            return rows
        return self.pattern_of(input_ids).to(self.dtype)

    @property
    def weight(self) -> EmbeddingRows:
        """Rows of the stand-in table by index, for models that read `embed_tokens.weight[token_id]` (Gemma 4's
        padding embedding) without holding the table."""
        return EmbeddingRows(self)

    def pattern_of(self, input_ids: torch.Tensor) -> torch.Tensor:
        columns = torch.arange(self.hidden_size, dtype=torch.float64, device=input_ids.device)
        return torch.sin(input_ids.to(torch.float64)[..., None] * 0.731 + columns * 0.173 + 0.5) + 2.0


class EmbeddingRows:
    """`TextEmbedding.weight`: indexing it by token ids (then any columns) gives those ids' rows."""

    def __init__(self, embedding: TextEmbedding) -> None:
        self.embedding = embedding

    def __getitem__(self, key: Any) -> torch.Tensor:
        ids, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        rows = self.embedding(torch.as_tensor(ids, dtype=torch.long))
        return rows[(..., *rest)] if rest else rows


class LanguageModelTrap(torch.nn.Module):
    """In place of the language model: stops the forward with the `inputs_embeds` it is called with."""

    def __init__(self, embedding: TextEmbedding, config: Any) -> None:
        super().__init__()
        self.embed_tokens = embedding
        self.config = config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # What a model computes for its language model alone before calling it (Gemma 3n's per-layer
            # inputs): never reaches the rows, since the trap stops the forward first.
            if name.startswith("get_") and name != "get_input_embeddings":
                return lambda *args, **kwargs: None
            raise

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.embed_tokens = value

    def forward(self, *args: Any, **kwargs: Any) -> None:
        embeds = kwargs.get("inputs_embeds")
        if not isinstance(embeds, torch.Tensor):
            raise RuntimeError("the language model is called without inputs_embeds (the model splices its "
                               "features some other way)")
        raise Captured(embeds)


class LayerTrap(torch.nn.Module):
    """In place of the first decoder layer of a model whose multimodal embedder sits beside its layers."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        raise Captured(hidden_states)


def model_class_of(folder: Path, config: Any, model_type: str) -> type:
    """The `transformers` class the checkpoint was saved from, else the multimodal class registered for it."""
    import transformers
    from transformers.models.auto import modeling_auto

    registered = []
    for mapping in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES"):
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        registered.extend(name if isinstance(name, (list, tuple)) else [name] if name else [])
    if not registered:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not a multimodal model in transformers "
                              f"{transformers.__version__} (it has no image-text-to-text or multimodal LM class), so "
                              "there are no media rows to serve")
    names = [*(getattr(config, "architectures", None) or []), *registered]
    for name in names:
        model_class = getattr(transformers, name, None)
        if isinstance(model_class, type):
            return model_class
    raise CheckpointError(f"{folder}: model_type {model_type!r} has no multimodal model class in transformers "
                          f"{transformers.__version__}, so there are no media rows to serve")


def _owner(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name


def install_trap(model: torch.nn.Module, hidden_size: int, dtype: torch.dtype) -> TextEmbedding:
    """Replace the model's language model (or first decoder layer) by a trap and its embedding table by a
    `TextEmbedding`; drop the LM head. Returns the embedding stand-in (to switch it to the pattern)."""
    embedding = TextEmbedding(hidden_size, dtype)
    table = model.get_input_embeddings()
    embedding.source = next((f"{name}.weight" for name, module in model.named_modules() if module is table), "")
    named = [name for name, _ in model.named_modules() if name.rpartition(".")[2] in LANGUAGE_MODEL_NAMES]
    if named:
        owner, name = _owner(model, min(named, key=lambda name: name.count(".")))
        setattr(owner, name, LanguageModelTrap(embedding, getattr(getattr(owner, name), "config", None)))
    else:
        table = model.get_input_embeddings()
        paths = [name for name, module in model.named_modules() if getattr(module, "embed_tokens", None) is table]
        decoder = model.get_submodule(paths[0]) if paths else None
        layers = getattr(decoder, "layers", None)
        if decoder is None or decoder is model or not isinstance(layers, torch.nn.ModuleList):
            raise CheckpointError(f"{type(model).__name__}: no language model submodule to stop at (looked for "
                                  f"{', '.join(LANGUAGE_MODEL_NAMES)} or a text model holding the embedding table)")
        beside = [name for name, child in decoder.named_children()
                  if name not in ("embed_tokens", "layers", "norm", "rotary_emb")
                  and any(True for _ in child.parameters())]
        if beside:  # its multimodal embedder runs inside the text model: stop at the first layer
            decoder.layers = torch.nn.ModuleList([LayerTrap()])
            decoder.embed_tokens = embedding
            if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
                decoder.norm = torch.nn.Identity()
        else:
            owner, name = _owner(model, paths[0])
            setattr(owner, name, LanguageModelTrap(embedding, getattr(decoder, "config", None)))
    for head in ("lm_head",):
        if isinstance(getattr(model, head, None), torch.nn.Module):
            setattr(model, head, None)
    return embedding


def build_on_meta(model_class: type, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The whole model on the meta device in `dtype` (no memory, no init)."""
    from transformers import initialization

    with torch.device("meta"), initialization.meta_device_safe_creation_ops(), initialization.no_tie_weights():
        return model_class._from_config(config, dtype=dtype)


def build_trapped(model_class: type, config: Any, dtype: torch.dtype, hidden_size: int) -> tuple[torch.nn.Module,
                                                                                               TextEmbedding]:
    """The model on the meta device in `dtype`, its language model replaced by a trap."""
    model = build_on_meta(model_class, config, dtype)
    return model, install_trap(model, hidden_size, dtype)


def embedding_rows(folder: Path, model: torch.nn.Module, key: str, tokens: list[int]) -> dict[int, torch.Tensor]:
    """Rows of the language model's input embedding table (`key`, a model key) for these token ids, read from the
    folder's safetensors alone (the table is never loaded whole). The checkpoint key comes through `transformers`'
    own conversion mapping for the whole model (`model`, on the meta device: some of its renamings are scoped to
    the language model's class), as `from_pretrained` finds it; a table stored in parts concatenated on
    load (Molmo2's published `wte.embedding` + `wte.new_embedding`) is read from the part holding each row."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    from encode_server.models.loading.checkpoint import _shard_files

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    files = _shard_files(folder)
    sources: list[tuple[str, str | None]] = []
    for checkpoint_key in sorted(files, key=dot_natural_key):
        renamed, pattern = rename_source_key(checkpoint_key, renamings, converters, model.base_model_prefix,
                                             {key: None})
        if renamed == key or checkpoint_key == key:
            sources.append((checkpoint_key, pattern))
    if not sources:
        raise CheckpointError(f"{folder}: the checkpoint holds no {key}, the embedding rows its placeholders add")
    if len(sources) > 1 or sources[0][1] is not None:
        converter = next((c for c in converters if sources[0][1] in c.source_patterns), None)
        if converter is None or [type(op) for op in converter.operations] != [Concatenate] or \
                converter.operations[0].dim != 0:
            raise CheckpointError(f"{folder}: its embedding table {key} is stored converted, which is not read "
                                  "row by row here")
        order = {pattern: index for index, pattern in enumerate(converter.source_patterns)}
        sources.sort(key=lambda source: order[source[1]])
    rows: dict[int, torch.Tensor] = {}
    start = 0
    for checkpoint_key, _ in sources:
        with safe_open(str(files[checkpoint_key]), "pt") as handle:
            part = handle.get_slice(checkpoint_key)
            count = int(part.get_shape()[0])
            for token in tokens:
                if start <= token < start + count:
                    rows[token] = part[token - start:token - start + 1][0].clone()
        start += count
    missing = sorted(set(tokens) - set(rows))
    if missing:
        raise CheckpointError(f"{folder}: its embedding table {key} has no rows for tokens {missing}")
    return rows
