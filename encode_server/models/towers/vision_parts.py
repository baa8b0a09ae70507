"""The vision half of a `transformers` vision-language model, built and loaded without its language model.

The families here call the model's own `get_image_features`, so the rows they ship are exactly what
`transformers` splices into the prompt. To get there without building the language model, the
model's base class (e.g. `Gemma3Model`) is constructed on the meta device (no memory, no init), its
`language_model` is dropped, and the rest is materialised and filled from the checkpoint, the way
`from_pretrained` does it:

- checkpoint keys are matched with `transformers`' own conversion mapping for that class
  (`get_model_conversion_mapping` + `rename_source_key`), so published layouts
  (`vision_tower.vision_model.*`, `language_model.model.*`) and the layout `save_pretrained`
  writes today both load;
- only the kept modules' tensors are read from the safetensors shards (`read_tensors`), and they are
  loaded by `transformers`' own `convert_and_load_state_dict_in_model`, so a key that needs a
  conversion *operation* (Kimi K2.5's fused, rope-permuted `wqkv` split into q, k and v) is
  converted exactly as `from_pretrained` converts it;
- non-persistent buffers (position ids, rotary frequencies) are filled by the model's own
  `initialize_weights`, exactly as `from_pretrained` fills them.

`VisionPartAdapter` is the shared adapter base: device, dtype, `ModelInfo`, its processor, and rows on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from encode_server.models.base import EncoderAdapter, ModelInfo
from encode_server.models.loading.checkpoint import CheckpointError, _shard_files, read_tensors
from processors.base import Processor

DROPPED_MODULES = ("language_model", "lm_head")


def build_without_language_model(model_class: type, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The base model on the meta device in `dtype` (buffers the model builds in float32 stay so, as with
    `from_pretrained(dtype=...)`), its language model (and any LM head) removed."""
    from transformers import initialization

    with torch.device("meta"), initialization.meta_device_safe_creation_ops(), initialization.no_tie_weights():
        model = model_class._from_config(config, dtype=dtype)
    if not isinstance(getattr(model, "language_model", None), torch.nn.Module):
        raise CheckpointError(f"{model_class.__name__} has no `language_model` submodule, so its vision part "
                              "cannot be built on its own")
    for name in DROPPED_MODULES:
        if isinstance(getattr(model, name, None), torch.nn.Module):
            setattr(model, name, None)
    return model


def _checkpoint_plan(model: torch.nn.Module, files: dict[str, Path]) -> tuple[list[str], set[str]]:
    """The checkpoint keys that hold this model's tensors, through `transformers`' own conversion mapping for
    it, and the model keys they fill. A key a converter takes (e.g. a fused `wqkv` split into q, k, v) fills
    every target of that converter."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    wanted = model.state_dict()
    keys, filled = [], set()
    # In `from_pretrained`'s order: some renamings (GroupWeightRename) are armed by an earlier key.
    for checkpoint_key in sorted(files, key=dot_natural_key):
        key, pattern = rename_source_key(checkpoint_key, renamings, converters, model.base_model_prefix, wanted)
        if key not in wanted and checkpoint_key in wanted:
            key, pattern = checkpoint_key, None
        if key not in wanted:
            continue
        keys.append(checkpoint_key)
        if pattern is None:
            filled.add(key)
        else:
            targets = by_pattern[pattern].target_patterns
            filled.update(key.replace(targets[0], target) for target in targets)
    return keys, filled


def _shown(keys: Any) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def load_vision_part(folder: Path, model_class: type, config: Any, device: torch.device,
                     dtype: torch.dtype) -> torch.nn.Module:
    """The base model without its language model, filled from the folder's safetensors, on `device`."""
    return load_model_part(folder, build_without_language_model(model_class, config, dtype), device)


def load_model_part(folder: Path, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A model built on the meta device with the parts it does not need removed, filled from the folder's
    safetensors, on `device`.

    Only the kept modules' checkpoint tensors are read (one `read_tensors` call, so `encoder_keys_of` learns
    them), then they go through `transformers`' own loading step (`convert_and_load_state_dict_in_model`,
    with the model's conversion mapping), converted exactly as `from_pretrained` converts them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as transformers_logging

    files = _shard_files(folder)
    keys, filled = _checkpoint_plan(model, files)
    persistent = set(model.state_dict())
    missing = persistent - filled
    if missing:
        raise CheckpointError(f"{folder}: the checkpoint lacks {len(missing)} encoder tensors: {_shown(missing)}")
    state = read_tensors(folder, files, {key: key for key in keys})  # checkpoint key -> its tensor
    model.to_empty(device="cpu")
    # Everything the checkpoint holds is marked initialised, so `initialize_weights` fills only the
    # non-persistent buffers, as `from_pretrained` does; the loaded tensors replace the rest after it anyway.
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in filled:
            tensor._is_hf_initialized = True
    model.initialize_weights()
    progress_bar = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a few small tensors: no "Loading weights" bar in the log
    try:
        info, _ = convert_and_load_state_dict_in_model(model, state, LoadStateDictConfig(
            weight_mapping=get_model_conversion_mapping(model), device_map={"": "cpu"}))
    finally:
        if progress_bar:
            transformers_logging.enable_progress_bar()
    problems = [f"{what}: {_shown(found)}" for what, found in (
        ("not filled", info.missing_keys & persistent), ("wrong shape", [k for k, *_ in info.mismatched_keys]),
        ("conversion failed", info.conversion_errors), ("unexpected", info.unexpected_keys)) if found]
    if problems or info.error_msgs:
        raise CheckpointError(f"{folder}: the encoder's tensors do not load: {'; '.join(problems + info.error_msgs)}")
    return model.to(device=device).eval()


class VisionPartAdapter(EncoderAdapter):
    """Shared plumbing of the adapters that run a `transformers` model's own `get_image_features`."""

    def __init__(self, name: str, family: str, model: torch.nn.Module, hidden_size: int, processor: Processor,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model.to(device=device).eval()  # already in `dtype` (see load_vision_part)
        self.processor = processor
        self.device = device
        self.dtype = dtype
        self.info = ModelInfo(name=name, family=family, modalities=("image",), hidden_size=int(hidden_size))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Pixels in the encoder's dtype on its device; integer tensors (sizes) keep their dtype."""
        if tensor.is_floating_point():
            return tensor.to(device=self.device, dtype=self.dtype, non_blocking=True)
        return tensor.to(device=self.device, non_blocking=True)

    @staticmethod
    def flat_rows(pooler_output: Any) -> torch.Tensor:
        """`get_image_features(...).pooler_output` (a tensor or a tuple of them) as rows `[tokens, hidden]` on CPU."""
        parts = pooler_output if isinstance(pooler_output, (list, tuple)) else [pooler_output]
        rows = torch.cat([part.reshape(-1, part.shape[-1]) for part in parts])
        return rows.to("cpu").contiguous()


def require_torchvision(family: str) -> None:
    """Refuse to load a family whose processors need torchvision where it is not installed."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise CheckpointError(f"{family}: its image and video processors need torchvision, which is not installed; "
                              "install the torchvision build that matches torch (pip install torchvision)")
