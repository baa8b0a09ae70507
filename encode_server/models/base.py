"""The model-adapter interface: how the service talks to an encoder family.

An adapter turns decoded media items into encoder inputs with one processor call for a whole batch
(`preprocess`), runs one forward for the batch (`forward`), and knows how many output rows each
item produces (`item_layout`, from the model's own grid). `split_rows` checks those counts against
the forward's actual row count and slices the output, once, per request. Nothing here knows about HTTP,
queues or time: the scheduler and engine only call these methods.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from encode_server.models.dtypes import DTYPES

#: Where a processor that supports it (`fast_patches`) puts its float32 pixel rows: a callable
#: `(rows, width) -> tensor`, or None for a new tensor. Set around a processor call with `pixels_allocated_by`
#: (a preprocessing worker points it into its shared-memory slot, so that sending the rows copies nothing).
PIXELS_ALLOCATOR: contextvars.ContextVar[Callable[[tuple[int, int]], torch.Tensor] | None] = \
    contextvars.ContextVar("fast_patches_pixels_allocator", default=None)


def new_pixels(shape: tuple[int, int]) -> torch.Tensor:
    """A new float32 tensor for pixel rows (huge pages with THP_MEM_ALLOC_ENABLE=1)."""
    return torch.empty(shape, dtype=torch.float32)


@contextlib.contextmanager
def pixels_allocated_by(allocate: Callable[[tuple[int, int]], torch.Tensor]) -> Iterator[None]:
    """Within the block, the table-lookup processors write their pixel rows into `allocate(shape)`."""
    token = PIXELS_ALLOCATOR.set(allocate)
    try:
        yield
    finally:
        PIXELS_ALLOCATOR.reset(token)


class ItemError(ValueError):
    """An item the model cannot take (too small, wrong aspect ratio, ...); its request gets a 400."""


@dataclass(frozen=True)
class ItemLayout:
    """How many embedding rows one item becomes, and the model's grid for it."""

    tokens: int
    grid_thw: tuple[int, int, int]
    # Audio: the clip's length in feature-extractor (mel) frames, what SGLang's receiver takes as the
    # item's grid. Not part of equality: a layout is defined by its rows and grid.
    mel_frames: int | None = field(default=None, compare=False)
    # What SGLang's receiver takes as the item's grid where the model's language side reads something other
    # than `grid_thw` (or, for audio, `mel_frames`): a merged token grid, an audio clip's row count. Not part
    # of equality.
    receiver_grid: int | tuple[int, ...] | None = field(default=None, compare=False)
    # A video's temporal clips: the frame position (an index into the frames as sampled) each clip's timestamp
    # is taken at; the SGLang wire divides them by the sampling fps into `video_timestamps`. Not part of equality.
    clip_frames: tuple[float, ...] | None = field(default=None, compare=False)
    # Video, for models whose prompt names each temporal patch's time (Qwen3-VL, Qwen3.5): the seconds
    # of each of the `t` patches (`inputs/video_clip.py`). Not part of equality either.
    video_timestamps: tuple[float, ...] | None = field(default=None, compare=False)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.tokens, "grid_thw": list(self.grid_thw)}
        if self.video_timestamps is not None:
            out["video_timestamps"] = list(self.video_timestamps)
        return out


@dataclass
class PreparedBatch:
    """A batch's encoder inputs from one processor call, with each item's expected layout."""

    modality: str
    inputs: dict[str, torch.Tensor]
    layouts: list[ItemLayout]
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(layout.tokens for layout in self.layouts)


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
        return self.hidden_size * (1 + self.deepstack)

    def deepstack_of(self, modality: str) -> int:
        """The deepstack blocks in the rows of this modality."""
        if self.deepstack_modalities is not None and modality not in self.deepstack_modalities:
            return 0
        return self.deepstack

    def row_width_of(self, modality: str) -> int:
        """The width of this modality's rows."""
        return self.hidden_size * (1 + self.deepstack_of(modality))


class EncoderAdapter(ABC):
    """One encoder family: preprocessing, the forward, and per-item token counts."""

    info: ModelInfo
    device: torch.device
    dtype: torch.dtype

    def supports(self, modality: str) -> bool:
        return modality in self.info.modalities

    @abstractmethod
    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        """The rows one decoded item will produce; cheap (no pixels touched). Raises ItemError."""

    def before_batch(self, modality: str, jobs: Sequence[Any]) -> None:  # noqa: B027 (optional hook)
        """Called as a batch is formed, before `preprocess` (tensor parallelism announces it here)."""

    @abstractmethod
    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        """One processor call for all items of a batch (CPU work, runs in a thread)."""

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Fuse per-item `preprocess` results into the batch one `preprocess` over all items would give.

        The default concatenates every input tensor along dim 0 (pixel rows, tiles, clips, grids) and keeps
        the layouts in order; `extras` are merged, later batches winning. A family whose processor pads
        items to the batch's longest (so that one item's inputs depend on its neighbours) overrides this.
        One batch comes back as it is, without a copy.
        """
        if not batches:
            raise ValueError("collate needs at least one prepared batch")
        if len(batches) == 1:
            return batches[0]
        modality, keys = batches[0].modality, list(batches[0].inputs)
        for batch in batches[1:]:
            if batch.modality != modality or list(batch.inputs) != keys:
                raise ValueError(f"cannot collate a {batch.modality} batch with inputs {list(batch.inputs)} into a "
                                 f"{modality} batch with inputs {keys}")
        inputs = {key: torch.cat([batch.inputs[key] for batch in batches]) for key in keys}
        extras: dict[str, Any] = {}
        for batch in batches:
            extras.update(batch.extras)
        return PreparedBatch(modality=modality, inputs=inputs,
                             layouts=[layout for batch in batches for layout in batch.layouts], extras=extras)

    def preprocessing_copy(self) -> EncoderAdapter:
        """A picklable copy that can `item_layout` and `preprocess` but holds none of the model.

        Preprocessing processes get this copy (`encode_server/preprocessing/pool.py`). The default is a shallow
        copy with every `torch.nn.Module` attribute dropped; an adapter that keeps other unpicklable state
        (sockets, process groups, threads) overrides it.
        """
        clone = copy.copy(self)
        for name, value in list(vars(clone).items()):
            if isinstance(value, torch.nn.Module):
                delattr(clone, name)
        return clone

    @abstractmethod
    def forward(self, batch: PreparedBatch) -> torch.Tensor:
        """One encoder forward for the batch: rows of all items concatenated, `[tokens, hidden]`, on CPU."""

    def forward_items(self, batches: Sequence[PreparedBatch]) -> tuple[list[ItemLayout], torch.Tensor]:
        """One forward over per-item `preprocess` results (the preprocessing pool's), in order: the layouts
        and the rows of `forward(collate(batches))`. An adapter whose tower can take the items' inputs
        separately overrides it, to skip the copy that concatenating them costs."""
        prepared = self.collate(batches)
        return prepared.layouts, self.forward(prepared)

    @abstractmethod
    def sample_item(self) -> tuple[str, Any]:
        """A tiny decoded item of a supported modality, for warm-up and health probes."""

    def sample_encoded(self) -> tuple[str, bytes]:
        """`sample_item` as the bytes of a file a client could send, for the health probe and the preprocessing
        workers' warm-up: an image as PNG, an audio clip as WAV at the adapter's `sampling_rate`. A model whose
        sample is a video says which modality to probe instead (`sample_item` picks an image or audio where
        the model takes one)."""
        import io

        from PIL import Image

        modality, item = self.sample_item()
        buffer = io.BytesIO()
        if isinstance(item, Image.Image):
            item.save(buffer, "PNG")
        elif modality == "audio":
            import numpy as np
            import soundfile

            soundfile.write(buffer, np.asarray(item, dtype=np.float32), int(getattr(self, "sampling_rate", 16000)),
                            format="WAV")
        else:
            raise TypeError(f"{type(self).__name__}: no file form for a sample {modality} item "
                            f"({type(item).__name__}); sample_item must give an image or an audio clip")
        return modality, buffer.getvalue()

    def warmup(self) -> None:
        """One forward on a tiny input, so the first real request does not pay for lazy initialisation."""
        modality, item = self.sample_item()
        self.forward(self.preprocess(modality, [item]))

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
