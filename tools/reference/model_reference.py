"""The model's own features for what a processor made of an item: the rows its language model receives in a
monolithic server. Shared by the compatibility scripts (`tools/compat/vllm_compat.py`, `tools/compat/sglang_compat.py`),
which compare the rows this server gives with them."""

from __future__ import annotations

from typing import Any


def whole_model(folder) -> object:
    """The whole model (language model included) of a checkpoint folder, in float32: the class `AutoModel` maps
    for image-text models, else the class its config names (the Omni models, whose thinker holds the towers)."""
    import json
    from pathlib import Path

    import torch
    import transformers

    try:
        model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    except ValueError:
        architecture = getattr(transformers, json.loads((Path(folder) / "config.json").read_text())["architectures"][0])
        # PreTrainedModel's own loader: the Omni classes' override also loads the talker's speakers (spk_dict.pt),
        # which a checkpoint of the towers and the thinker does not need.
        model = transformers.PreTrainedModel.from_pretrained.__func__(architecture, folder, dtype=torch.float32)
    return model.eval()


def towers_owner(model: Any, modality: str) -> Any:
    """The part of a whole model that has `get_<modality>_features`: the model, its `model`, or an Omni thinker."""
    name = f"get_{modality}_features"
    return next((part for part in (model, getattr(model, "model", None), getattr(model, "thinker", None))
                 if part is not None and hasattr(part, name)), None)


def own_features(model: Any, modality: str, pixels: Any, grid: Any) -> Any:
    """`get_<modality>_features(pixels, grid)` as one `[rows, width]` tensor: the items' rows in order, each row its
    main features then any deepstack levels side by side (the server's layout); None where the model has none."""
    import torch

    owner = towers_owner(model, modality)
    if owner is None:
        return None
    with torch.no_grad():
        out = getattr(owner, f"get_{modality}_features")(pixels, grid)
    main = getattr(out, "pooler_output", out)
    main = torch.cat(list(main)) if isinstance(main, (list, tuple)) else main
    deepstack = [torch.cat(list(level)) if isinstance(level, (list, tuple)) else level
                 for level in getattr(out, "deepstack_features", None) or []]
    return torch.cat([main, *deepstack], dim=-1) if deepstack else main
