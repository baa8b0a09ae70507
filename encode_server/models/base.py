"""The model-adapter interface: how the service talks to an encoder family's tower.

An adapter holds its family's processor (`processor`, a `processors.Processor`: decoded media items to the
tower's inputs with one call for a whole batch, and how many output rows each item produces, from the model's
own grid) and runs one forward for the batch (`forward`). `split_rows` checks the processor's counts against
the forward's actual row count and slices the output, once, per request. Nothing here knows about HTTP,
queues or time: the scheduler and engine only call these methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from encode_server.models.dtypes import DTYPES
from processors.base import ItemLayout, PreparedBatch, Processor


@dataclass(frozen=True)
class ModelInfo:
    """What `/server_info` says about the loaded encoder."""

    name: str
    family: str
    modalities: tuple[str, ...]
    hidden_size: int
    #: Deepstack feature blocks after the main features in each row (Qwen3-VL): rows are
    #: `[tokens, hidden_size * (1 + deepstack)]`, `torch.cat([main] + deepstack, dim=-1)`.
    deepstack: int = 0
    #: The modalities whose rows carry those blocks; None: every modality. Qwen3-Omni's image and video rows
    #: carry them, its audio rows (another tower) are `[tokens, hidden_size]`.
    deepstack_modalities: tuple[str, ...] | None = None
    #: Modality -> the tokens whose positions the rows fill, where the family measures them (the generic path).
    placeholder_tokens: dict[str, list[str]] | None = field(default=None, compare=False, hash=False)

    @property
    def row_width(self) -> int:
        """The width of one embedding row: the main features and every deepstack block."""
        return self.width_with(self.deepstack)

    def width_with(self, deepstack: int) -> int:
        """The width of a row of the main features and `deepstack` blocks: the one formula of a row's width."""
        return self.hidden_size * (1 + deepstack)

    def deepstack_of(self, modality: str) -> int:
        """The deepstack blocks in the rows of this modality."""
        if self.deepstack_modalities is not None and modality not in self.deepstack_modalities:
            return 0
        return self.deepstack

    def row_width_of(self, modality: str) -> int:
        """The width of this modality's rows."""
        return self.width_with(self.deepstack_of(modality))


class EncoderAdapter(ABC):
    """One encoder family's tower: the forward over what its processor prepared, and the rows sliced per item."""

    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    #: Media -> this tower's inputs (`processors`): the layouts, the processor call, the sample item.
    processor: Processor

    def supports(self, modality: str) -> bool:
        return modality in self.info.modalities

    def before_batch(self, modality: str, jobs: Sequence[Any]) -> None:  # noqa: B027 (optional hook)
        """Called as a batch is formed, before `processor.preprocess` (tensor parallelism announces it here)."""

    def preprocess_failed(self, modality: str, error: BaseException) -> None:  # noqa: B027 (optional hook)
        """Called in the forward's thread, in the place of `forward`, for a batch whose `processor.preprocess`
        raised (tensor parallelism tells the other ranks here)."""

    @abstractmethod
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """One encoder forward for the batch: rows of all items concatenated, `[tokens, hidden]`, on CPU."""

    def forward_items(self, batches: Sequence[PreparedBatch]) -> tuple[list[ItemLayout], torch.Tensor]:
        """One forward over per-item `preprocess` results (the preprocessing pool's), in order: the layouts
        and the rows of `forward(processor.collate(batches))`. An adapter whose tower can take the items' inputs
        separately overrides it, to skip the copy that concatenating them costs."""
        prepared = self.processor.collate(batches)
        return prepared.layouts, self.forward(prepared)

    def warmup(self) -> None:
        """One forward on a tiny input, so the first real request does not pay for lazy initialisation."""
        modality, item = self.processor.sample_item()
        self.forward(self.processor.preprocess(modality, [item]))

    def split_rows(self, layouts: Sequence[ItemLayout], rows: torch.Tensor,
                   items_per_group: Sequence[int]) -> list[torch.Tensor]:
        """Slice the forward's output into consecutive groups of items (one group per request), after
        checking the row count against the grid-derived counts. Each slice is a view of `rows`."""
        counts = [layout.tokens for layout in layouts]
        if rows.shape[0] != sum(counts):
            raise RuntimeError(
                f"{self.info.family}: forward produced {rows.shape[0]} rows but the items' grids "
                f"account for {sum(counts)}"
            )
        sizes, start = [], 0
        for group in items_per_group:
            sizes.append(sum(counts[start:start + group]))
            start += group
        return list(torch.split(rows, sizes))


class DeviceError(ValueError):
    """A device this process cannot use; the message says why and what to do instead."""


#: How to get a torch that can use NVIDIA GPUs, for the errors that find none.
CUDA_TORCH_HINT = ("install a CUDA build of torch from the PyTorch package index (pip install torch --index-url "
                   "https://download.pytorch.org/whl/cu<version>, the CUDA version your driver supports: "
                   "https://pytorch.org/get-started/locally), or use --device cpu")


def resolve_device(device: str, ranks: int = 1) -> torch.device:
    """`auto` means cuda when it is available, else cpu. A CUDA device this process cannot use, or fewer
    GPUs than `ranks` (each rank of a parallel server takes its own, `cuda:<rank>`), raise `DeviceError`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"--device {device!r} is not a device: expected auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        check_cuda(device, max((resolved.index or 0) + 1, ranks))
    return resolved


def check_cuda(device: str, needed: int) -> None:
    """`DeviceError` unless this torch can use `needed` CUDA devices (cuda:0 .. cuda:needed-1)."""
    if torch.version.cuda is None:
        raise DeviceError(f"--device {device}: CUDA is not available in this torch build (torch {torch.__version__} "
                          f"was built without CUDA): {CUDA_TORCH_HINT}")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device {device}: this torch has CUDA {torch.version.cuda} but sees no GPU: check the "
                          "NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, in a container the NVIDIA "
                          "container toolkit (docker run --gpus all); or use --device cpu")
    count = torch.cuda.device_count()
    if needed > count:
        raise DeviceError(f"--device {device}: {needed} CUDA devices are needed (the device named, and one per "
                          f"rank with --tp-size or --dp-size) but {count} {'is' if count == 1 else 'are'} visible")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` means bfloat16 on cuda and float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]
