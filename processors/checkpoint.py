"""Encoder-only loading from a Hugging Face checkpoint folder: the helpers every family's loader uses.

Only the encoder's modules are built (the language model never is), with weight initialisation
skipped, and only the encoder's tensors are read from the safetensors files (sharded ones through
`model.safetensors.index.json`), each one memory-mapped and read on its own. Checkpoint keys may
carry a leading `model.` (the layout `transformers` uses in memory) or not (the layout of published
checkpoints); both are accepted.
Which family serves a folder (by `config.json`'s `model_type`) is `processors/registry.py`'s job;
this module imports no family.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served; the message says what is wrong."""


def read_config(folder: Path) -> dict:
    """The folder's `config.json` as a dict."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def _shard_files(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as handle:
            return {key: single for key in handle.keys()}
    raise CheckpointError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def load_encoder_weights(module: torch.nn.Module, folder: Path) -> None:
    """Fill `module` (built without init) with its tensors from the folder, and only those."""
    wanted = set(module.state_dict().keys())
    files = _shard_files(folder)
    chosen: dict[str, str] = {}  # module key -> checkpoint key
    for checkpoint_key in files:
        key = checkpoint_key.removeprefix("model.") if checkpoint_key not in wanted else checkpoint_key
        if key in wanted and key not in chosen:
            chosen[key] = checkpoint_key
    missing = sorted(wanted - set(chosen))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: the checkpoint lacks {len(missing)} encoder tensors: {shown}")
    by_file: dict[Path, list[str]] = {}
    for key, checkpoint_key in chosen.items():
        by_file.setdefault(files[checkpoint_key], []).append(key)
    state: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        if not path.is_file():
            raise CheckpointError(f"{folder}: shard {path.name} named in the index is missing")
        with safe_open(str(path), "pt") as handle:
            for key in keys:
                state[key] = handle.get_tensor(chosen[key])
    module.load_state_dict(state, strict=True, assign=True)


def load_encoder_modules(folder: Path, build: Callable[[], dict[str, torch.nn.Module]]) -> torch.nn.ModuleDict:
    """Build the encoder's modules without random init, named as in the checkpoint, and load them."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        modules = torch.nn.ModuleDict(build())
    load_encoder_weights(modules, folder)
    return modules
