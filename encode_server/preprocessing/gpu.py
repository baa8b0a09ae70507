"""`--preprocess-device cuda`: image preprocessing on the GPU with `transformers`' fast image processors.

Every built-in image family preprocesses with a PIL-backend processor (`...ImageProcessorPil`). Its
torchvision-backend twin (the same name without `Pil`, in `image_processing_<model>.py`) takes the
same settings and accepts `device=`: resizing, rescaling, normalising and patchifying then run as
batched torch ops on that device. `use_device_preprocessing` swaps an adapter's `image_processor` for
`DeviceImageProcessor`, which sends the adapter's tensor calls (`return_tensors="pt"`) to the fast
processor on the GPU and everything else (Qwen's video path asks for numpy) to the PIL one.

Decoding stays on the CPU; the pool of preprocessing processes is not used with it (the GPU work is
one batched call per batch in the server process). Its token counts equal the PIL path's; its pixel
values differ by resampling only (docs/BENCHMARKS.md has the measured distance).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


class PreprocessDeviceError(ValueError):
    """`--preprocess-device cuda` cannot be honoured here (said at start-up)."""


def stock_class(processor: Any) -> type:
    """The `transformers` class of a processor: its own class, or for our fast copies (`processors/fast_patches.py`)
    the stock class they derive from (PIL-backend or torchvision-backend)."""
    for cls in type(processor).__mro__:
        if cls.__module__.startswith("transformers.models."):
            return cls
    return type(processor)


def fast_twin(pil_processor: Any) -> Any:
    """The torchvision-backend image processor with the same settings as a PIL-backend one."""
    cls = stock_class(pil_processor)
    module = cls.__module__
    if ".image_processing_" in module and ".image_processing_pil_" not in module and \
            not cls.__name__.endswith("Pil") and hasattr(pil_processor, "_preprocess"):
        # Already the torchvision backend: `AutoImageProcessor` picks it where torchvision is installed.
        return pil_processor
    if not cls.__name__.endswith("Pil") or ".image_processing_pil_" not in module:
        raise PreprocessDeviceError(f"{cls.__name__} is not a PIL-backend image processor with a fast twin")
    fast_module = importlib.import_module(module.replace(".image_processing_pil_", ".image_processing_"))
    fast_cls = getattr(fast_module, cls.__name__.removesuffix("Pil"))
    settings = {key: value for key, value in pil_processor.to_dict().items()
                if key not in ("image_processor_type", "processor_class", "backend")}
    return fast_cls(**settings)


class DeviceImageProcessor:
    """Stands in for a PIL image processor: tensor calls run on `device` through the fast twin."""

    def __init__(self, pil_processor: Any, device: torch.device) -> None:
        self.pil = pil_processor
        self.fast = fast_twin(pil_processor)
        self.device = device

    def __call__(self, images: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("return_tensors") == "pt":
            return self.fast(images=images, device=self.device, **kwargs)
        return self.pil(images=images, **kwargs)

    def __getattr__(self, name: str) -> Any:  # patch_size, merge_size, size, get_number_of_image_patches...
        return getattr(self.pil, name)


def check_preprocess_device(preprocess_device: str, adapter: Any) -> None:
    """Refuse `cuda` unless the model runs on a CUDA device, torchvision imports, and the family has a twin."""
    if preprocess_device == "cpu":
        return
    if preprocess_device != "cuda":
        raise PreprocessDeviceError(f"--preprocess-device must be cpu or cuda, got {preprocess_device!r}")
    if getattr(adapter, "device", torch.device("cpu")).type != "cuda":
        raise PreprocessDeviceError("--preprocess-device cuda needs the model on a CUDA device (--device cuda); "
                                    f"it runs on {adapter.device}")
    try:
        import torchvision  # noqa: F401
    except ImportError:
        raise PreprocessDeviceError("--preprocess-device cuda needs torchvision (transformers' fast image "
                                    "processors use it); install it or use --preprocess-device cpu") from None
    if getattr(adapter.processor, "image_processor", None) is None:
        raise PreprocessDeviceError(f"--preprocess-device cuda: model family {adapter.info.family!r} has no image "
                                    "processor to run on the GPU")
    fast_twin(adapter.processor.image_processor)


def use_device_preprocessing(adapter: Any, preprocess_device: str) -> None:
    """Check, then route the adapter's image preprocessing to its model's CUDA device."""
    check_preprocess_device(preprocess_device, adapter)
    if preprocess_device == "cuda":
        adapter.processor.image_processor = DeviceImageProcessor(adapter.processor.image_processor, adapter.device)
