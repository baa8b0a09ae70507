"""The list of encoder families (one module each under `families/`, plus the generic fallback) and the lookups over it.

Adding a family is one new module that ends with `FAMILY = Family(...)` plus one line in
`FAMILY_MODULES`. `load_checkpoint` picks a folder's family by `config.json`'s `model_type`;
a `model_type` no family declares goes to the generic family (`generic/adapter.py`), which serves
it only if its rows can be counted exactly and otherwise refuses, naming what is missing.
`builtin_models` gathers every family's built-in tiny models. `python -m encode_server.models.registry`
prints the README's model table.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from encode_server.models.base import EncoderAdapter
from encode_server.models.family import Family
from encode_server.models.loading.checkpoint import CheckpointError, read_config

FAMILY_MODULES: tuple[str, ...] = (
    "encode_server.models.families.qwen2_5_vl",
    "encode_server.models.families.qwen2_vl",
    "encode_server.models.families.internvl",
    "encode_server.models.families.qwen2_audio",
    "encode_server.models.families.qwen3_vl",
    "encode_server.models.families.glm4v",
    "encode_server.models.families.gemma3",
    "encode_server.models.families.llava_onevision",
    "encode_server.models.families.mistral3",
    "encode_server.models.families.qwen2_5_omni",
    "encode_server.models.families.qwen3_omni_moe",
    "encode_server.models.families.muse_spark",
    "encode_server.models.families.dots3_note",
    "encode_server.models.families.kimi_k25",
    "encode_server.models.families.glm5_next",
    "encode_server.models.families.minimax_m3_vl",
    "encode_server.models.generic.adapter",
)

# Serves a `model_type` no family declares, if its rows can be counted exactly; else it refuses, naming why.
FALLBACK_FAMILY = "generic"


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family, in `FAMILY_MODULES` order; names, model types and built-in names are unique."""
    found = tuple(importlib.import_module(module).FAMILY for module in FAMILY_MODULES)
    for what, values in (("family name", [f.name for f in found]),
                         ("model_type", [t for f in found for t in f.model_types]),
                         ("built-in model", [b for f in found for b in f.builtins])):
        duplicates = sorted({value for value in values if values.count(value) > 1})
        if duplicates:
            raise RuntimeError(f"{what} declared by more than one family: {', '.join(duplicates)}")
    return found


def family_named(name: str) -> Family | None:
    """The family whose `name` (as in `ModelInfo.family`) this is, if any."""
    return next((family for family in families() if family.name == name), None)


def family_for_model_type(model_type: str) -> Family | None:
    """The family that serves checkpoints of this `config.json` `model_type`, if any."""
    return next((family for family in families() if model_type in family.model_types), None)


def builtin_models() -> dict[str, Callable[[torch.device, torch.dtype], EncoderAdapter]]:
    """Built-in tiny model name -> its builder, over every family."""
    return {name: build for family in families() for name, build in family.builtins.items()}


def families_encoding(modality: str) -> list[Family]:
    """The families whose models encode `modality` (image, audio or video), in `FAMILY_MODULES` order."""
    return [family for family in families() if modality in family.modalities]


def supported_model_types() -> list[str]:
    return sorted(t for family in families() for t in family.model_types)


class ModelNotFound(CheckpointError):
    """`--model` names neither a built-in model nor an existing checkpoint folder (the message says which)."""


def looks_like_path(model: str) -> bool:
    """Whether `--model` is written as a folder's path rather than a model's name: absolute, from the home or
    the current folder, or of three segments or more (a name is `tiny-...`, a Hub id `org/name`)."""
    return (model in (".", "..") or model.startswith(("/", "~", "./", "../")) or "\\" in model
            or model.count("/") >= 2)


def model_not_found_message(model: str) -> str:
    """Why `--model` names nothing this server can load (neither a built-in model nor an existing folder),
    and what would."""
    if looks_like_path(model) or Path(model).expanduser().exists():
        path = Path(model).expanduser()
        where = str(path) if path.is_absolute() else f"{model} (relative to the working folder {Path.cwd()})"
        if path.exists():
            return f"{where} is a file, not a checkpoint folder (a folder with config.json and *.safetensors)"
        return (f"the folder {where} does not exist: give the path of a checkpoint folder (config.json and "
                f"*.safetensors, as save_pretrained writes them)")
    known = ", ".join(sorted(builtin_models()))
    return (f"unknown model {model!r}: neither a built-in model ({known}), an existing checkpoint folder, nor a "
            f"Hugging Face Hub id (org/name or org/name@revision); `python -m encode_server.models.registry` lists the "
            f"families a folder may hold")


def load_checkpoint(folder: str | Path, device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    """The encoder adapter for a checkpoint folder, chosen by `config.json`'s `model_type`."""
    folder = Path(folder).expanduser().resolve()
    model_type = read_config(folder).get("model_type")
    family = family_for_model_type(model_type) if isinstance(model_type, str) else None
    if family is None and isinstance(model_type, str):
        family = family_named(FALLBACK_FAMILY)
    if family is None:
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(supported_model_types())})")
    return family.load(folder, device, dtype)


def family_table_markdown() -> str:
    """The README's model table: one row per family."""
    lines = ["| family | `model_type` | built-in models | modalities | rows per item | `grid_thw` | tensor parallel |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for family in families():
        model_types = ", ".join(f"`{t}`" for t in family.model_types) or "any other"
        builtins = ", ".join(f"`{name}`" for name in family.builtins) or "none"
        tp = "yes" if family.shard is not None else "no"
        lines.append(f"| {family.name} | {model_types} | {builtins} | {', '.join(family.modalities)} | "
                     f"{family.row_formula} | {family.grid_thw} | {tp} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(family_table_markdown(), end="")
