"""Checks shared by the Kimi K2.5, GLM-5-Next and MiniMax-M3 VL family tests, against `transformers` itself.

- `check_fused`: items of different sizes preprocessed and encoded in one forward give each item exactly what
  the family's reference (the model's own `get_image_features` / `get_video_features` on that item alone)
  gives, within 1e-5 relative; so does the preprocessing pool's path (`forward_items` over per-item batches).
- `check_prompt_rows`: the full `transformers` processor, given one item and the model's prompt, inserts as
  many placeholder tokens as the item's rows, and the model's own forward splices exactly our rows there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tests.support.helpers import rel_diff


class _Spliced(Exception):
    """Raised by the hook once the language model's input embeddings are seen: the LM never runs."""


def spliced_rows(model: torch.nn.Module, inputs: dict, mask: torch.Tensor) -> torch.Tensor:
    """The rows the model's own forward puts at the `mask` positions of prompt 0 (the language model not run)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]
        raise _Spliced

    handle = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Spliced:
        pass
    finally:
        handle.remove()
    return captured["embeds"][0][mask[0]]


def check_fused(adapter, modality: str, items: Sequence[Any], reference: Callable[[Any], torch.Tensor]) -> None:
    batch = adapter.processor.preprocess(modality, items)
    assert batch.layouts == [adapter.processor.item_layout(modality, item) for item in items]
    assert len({layout.grid_thw for layout in batch.layouts}) >= 3, "the batch should mix item sizes"
    fused = adapter.forward(batch)
    assert fused.shape == (batch.total_tokens, adapter.info.row_width)
    pieces = adapter.split_rows(batch.layouts, fused, [1] * len(items))
    for item, layout, got in zip(items, batch.layouts, pieces, strict=True):
        want = reference(item)
        assert got.shape == want.shape, (layout, got.shape, want.shape)
        assert rel_diff(got, want) <= 1e-5, layout
    layouts, rows = adapter.forward_items([adapter.processor.preprocess(modality, [item]) for item in items])
    assert layouts == batch.layouts and rel_diff(rows, fused) <= 1e-5


def check_prompt_rows(adapter, processor, modality: str, items: Sequence[Any], prompt: str, token: str,
                      model: torch.nn.Module | None = None) -> None:
    """Per item: placeholders the full processor inserts == `item_layout` tokens == our rows (== the rows the
    model splices there, when `model` is given)."""
    token_id = processor.tokenizer.convert_tokens_to_ids(token)
    for item in items:
        media = {"images": [item]} if modality == "image" else {"videos": [item], "do_sample_frames": False}
        inputs = processor(text=[prompt], return_tensors="pt", **media)
        mask = inputs["input_ids"] == token_id
        rows = adapter.forward(adapter.processor.preprocess(modality, [item]))
        assert adapter.processor.item_layout(modality, item).tokens == int(mask.sum()) == rows.shape[0]
        if model is not None:
            assert rel_diff(rows, spliced_rows(model, inputs, mask)) <= 1e-5
