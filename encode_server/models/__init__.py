"""The model layer: encoder families behind one adapter interface; `load_adapter` picks one by name, folder or
Hub id. It imports nothing else of the server but `processors` (the layout test keeps it below every other layer).

`base.py` is the adapter interface (`EncoderAdapter`: a tower holding its `processors.Processor`), `dtypes.py` the
one table of embedding dtypes, `family.py` what a family declares, `registry.py` the list of families,
`builtin.py` the fixed seed of the built-in tiny models. Below: `families/` (one module per family: its tower, its
loader and the checks of its processor against its tower), `generic/` (the fallback family), `towers/` (adapters
several families share), `layers/` (faster equivalent layers), `loading/` (checkpoints, Hub) and `sharding/`
(tensor-parallel plans). Media -> tower inputs is the top-level `processors` package, which this layer imports
(never the reverse); the records it makes (`ItemLayout`, `PreparedBatch`, `ItemError`) are re-exported here.
`BUILTIN_MODELS` (built-in tiny model name -> builder) is gathered from the registry on first use, so importing
this package stays cheap.
"""

from __future__ import annotations

from typing import Any

from encode_server.models.base import DeviceError, EncoderAdapter, ModelInfo, resolve_device, resolve_dtype
from encode_server.models.dtypes import DTYPE_NAMES
from processors.base import ItemError, ItemLayout, PreparedBatch, Processor

__all__ = ["DTYPE_NAMES", "DeviceError", "EncoderAdapter", "ItemError", "ItemLayout", "ModelInfo", "PreparedBatch",
           "Processor", "load_adapter", "resolve_model", "BUILTIN_MODELS"]


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_MODELS":
        from encode_server.models.registry import builtin_models

        return builtin_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_model(model: str) -> str:
    """What `--model` names, as something `load_adapter` loads without the network: a built-in name or an
    existing folder as it is; a Hub id `org/name[@revision]` as its local encoder-only folder, downloaded
    on first use (`loading/hub.py`). Anything else is a `ModelNotFound` saying what `--model` may be."""
    from pathlib import Path

    from encode_server.models.registry import ModelNotFound, builtin_models, looks_like_path, model_not_found_message

    builtins = builtin_models()
    if model in builtins or Path(model).expanduser().is_dir():
        return model
    from encode_server.models.loading.hub import encoder_checkpoint, parse_hub_id

    hub_id = None if looks_like_path(model) or Path(model).expanduser().exists() else parse_hub_id(model)
    if hub_id is not None:
        return str(encoder_checkpoint(hub_id))
    raise ModelNotFound(model_not_found_message(model))


def load_adapter(model: str, device: str = "auto", dtype: str = "auto", name: str | None = None) -> EncoderAdapter:
    """The encoder for a built-in model name, a local Hugging Face checkpoint folder, or a Hub id (see
    `resolve_model`). `name` is what `/server_info` calls it; by default the built-in name, the folder's
    name, or the Hub id as given."""
    import dataclasses

    from encode_server.models.registry import builtin_models, load_checkpoint

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    local = resolve_model(model)
    builder = builtin_models().get(local)
    adapter = builder(torch_device, torch_dtype) if builder is not None else load_checkpoint(local, torch_device,
                                                                                             torch_dtype)
    name = name or (model if local != model else None)
    if name is not None and name != adapter.info.name:
        adapter.info = dataclasses.replace(adapter.info, name=name)
    return adapter
