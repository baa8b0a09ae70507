"""Encoder-only loading from a Hugging Face checkpoint folder: the helpers every family's loader uses.

Only the encoder's modules are built (the language model never is), with weight initialisation
skipped, and only the encoder's tensors are read from the safetensors files (sharded ones through
`model.safetensors.index.json`), each one memory-mapped and read on its own. Checkpoint keys may
carry a leading `model.` (the layout `transformers` uses in memory) or not (the layout of published
checkpoints); both are accepted. A family whose encoder sits deeper in the checkpoint (the Omni
models' `thinker.`) names the prefixes to strip.
Which family serves a folder (by `config.json`'s `model_type`) is `registry.py`'s job;
this module imports no family.

Every family reads its encoder's tensors through `read_tensors`, in one call, after it has chosen
them by its own rules (its modules' state-dict keys, `transformers`' renamings). `encoder_keys_of`
uses that: it runs a family's loader on a folder that holds the config and processor files but no
weights, only a list of the checkpoint's keys, and stops it at that call, so the keys the encoder
needs are known before a single tensor byte is read (`loading/hub.py` fetches just those).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from processors.base import CheckpointError  # one error for a folder that cannot be served, processor or tower


def read_config(folder: Path) -> dict:
    """The folder's `config.json` as a dict."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


@dataclass(frozen=True)
class _KeyListing:
    """A folder whose weights are not there, only the names of the checkpoint's keys and their files."""

    folder: Path
    files: dict[str, str]  # checkpoint key -> safetensors file name


_listing: ContextVar[_KeyListing | None] = ContextVar("encoder_key_listing", default=None)


class _EncoderKeysChosen(BaseException):
    """Raised at a family's tensor read under `encoder_keys_of`; a BaseException so that no loader's
    `except Exception` can swallow it."""

    def __init__(self, keys: dict[str, str]) -> None:
        super().__init__(f"{len(keys)} encoder tensors chosen")
        self.keys = keys


def encoder_keys_of(folder: Path, files: dict[str, str], load: Callable[[], object]) -> dict[str, str]:
    """The checkpoint keys (-> file name) that `load` (a family's loader on `folder`) reads, given the
    checkpoint's keys and files (`files`, as the index or the headers list them) instead of weights.

    `load` runs up to its `read_tensors` call and is stopped there; a folder it cannot serve raises
    its `CheckpointError` as usual (a missing encoder tensor included), before anything is read."""
    token = _listing.set(_KeyListing(folder.expanduser().resolve(), dict(files)))
    try:
        load()
    except _EncoderKeysChosen as chosen:
        return chosen.keys
    finally:
        _listing.reset(token)
    raise CheckpointError(f"{folder}: the family's loader read no tensors, so its encoder's keys are unknown")


def _listed(folder: Path) -> _KeyListing | None:
    listing = _listing.get()
    return listing if listing is not None and listing.folder == folder.expanduser().resolve() else None


def _shard_files(folder: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file that holds it."""
    listing = _listed(folder)
    if listing is not None:
        return {key: folder / name for key, name in listing.files.items()}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {key: folder / name for key, name in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as handle:
            return {key: single for key in handle.keys()}
    raise CheckpointError(f"{folder} has no model.safetensors or model.safetensors.index.json (.bin weights are not "
                          f"read): convert it once (transformers' from_pretrained, then save_pretrained to a new "
                          f"folder, which writes safetensors) and pass that folder as --model")


#: What a checkpoint key may carry in front of the encoder module's own key.
DEFAULT_PREFIXES = ("model.",)


def _module_key(checkpoint_key: str, wanted: set[str], prefixes: tuple[str, ...]) -> str | None:
    """The encoder module key a checkpoint key holds: itself, or itself without the first of `prefixes` that
    makes it one; None for a tensor of another part of the model."""
    if checkpoint_key in wanted:
        return checkpoint_key
    for prefix in prefixes:
        if checkpoint_key.startswith(prefix) and checkpoint_key[len(prefix):] in wanted:
            return checkpoint_key[len(prefix):]
    return None


def load_encoder_weights(module: torch.nn.Module, folder: Path, prefixes: tuple[str, ...] = DEFAULT_PREFIXES) -> None:
    """Fill `module` (built without init) with its tensors from the folder, and only those."""
    wanted = set(module.state_dict().keys())
    files = _shard_files(folder)
    chosen: dict[str, str] = {}  # module key -> checkpoint key
    for checkpoint_key in files:
        key = _module_key(checkpoint_key, wanted, prefixes)
        if key is not None and key not in chosen:
            chosen[key] = checkpoint_key
    missing = sorted(wanted - set(chosen))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: the checkpoint lacks {len(missing)} encoder tensors: {shown}")
    module.load_state_dict(read_tensors(folder, files, chosen), strict=True, assign=True)


def read_tensors(folder: Path, files: dict[str, Path], chosen: dict[str, str]) -> dict[str, torch.Tensor]:
    """The chosen tensors (module key -> checkpoint key), each read on its own from its shard.

    A family reads all its encoder's tensors in one call to this, after choosing them (see
    `encoder_keys_of`)."""
    listing = _listed(folder)
    if listing is not None:
        raise _EncoderKeysChosen({checkpoint_key: listing.files[checkpoint_key] for checkpoint_key in chosen.values()})
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
    return state


def load_encoder_modules(folder: Path, build: Callable[[], dict[str, torch.nn.Module]],
                         prefixes: tuple[str, ...] = DEFAULT_PREFIXES) -> torch.nn.ModuleDict:
    """Build the encoder's modules without random init, named as in the checkpoint (after one of `prefixes`),
    and load them."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        modules = torch.nn.ModuleDict(build())
    load_encoder_weights(modules, folder, prefixes)
    return modules
