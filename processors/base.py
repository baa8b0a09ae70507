"""The processor interface: decoded media items to a tower's inputs, and how many rows each item becomes.

A `Processor` turns a batch's decoded items into the tensors a tower takes with one call (`preprocess`), says
cheaply how many rows each item will produce and the model's grid for it (`item_layout`, without touching
pixels), fuses per-item results into one batch (`collate`), and gives a tiny sample item for warm-up and the
health probe. It holds no model: it pickles as it is into the preprocessing workers. The records it makes
(`ItemLayout`, `PreparedBatch`) are what the model layer's forward takes and what the server slices by.
Nothing here knows of the server, HTTP, queues or time.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

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


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be served; the message says what is wrong."""


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
    # of each of the `t` patches (`video_clip.py`). Not part of equality either.
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


def concatenated(batches: Sequence[PreparedBatch]) -> PreparedBatch:
    """Per-item batches as one: every input tensor concatenated along dim 0, layouts in order, `extras` merged
    (later batches winning); one batch comes back as it is, without a copy."""
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


class Processor(ABC):
    """One family's media -> tower inputs. Holds settings and `transformers` processors, never a model, so it
    pickles into the preprocessing workers as it is."""

    #: The modalities the processor takes (the tower's own).
    modalities: tuple[str, ...]
    #: The audio sampling rate items are decoded at (the feature extractor's; 16 kHz for a model without audio).
    sampling_rate: int = 16000
    #: Whether `preprocess` may run for two batches at once, in two threads: a processor that keeps no state
    #: between calls and calls nothing that does (a Rust tokenizer, for one, refuses a second caller while its
    #: settings change), so the engine may prepare two batches side by side with it.
    concurrent_calls: bool = False

    def supports(self, modality: str) -> bool:
        return modality in self.modalities

    @abstractmethod
    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        """The rows one decoded item will produce; cheap (no pixels touched). Raises ItemError."""

    @abstractmethod
    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        """One processor call for all items of a batch (CPU work, runs in a thread)."""

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Fuse per-item `preprocess` results into the batch one `preprocess` over all items would give.

        The default concatenates every input tensor along dim 0 (pixel rows, tiles, clips, grids) and keeps
        the layouts in order (`concatenated`). A family whose processor pads items to the batch's longest (so
        that one item's inputs depend on its neighbours) overrides this.
        """
        return concatenated(batches)

    @abstractmethod
    def sample_item(self) -> tuple[str, Any]:
        """A tiny decoded item of a supported modality, for warm-up and health probes."""

    def sample_encoded(self) -> tuple[str, bytes]:
        """`sample_item` as the bytes of a file a client could send, for the health probe and the preprocessing
        workers' warm-up: an image as PNG, an audio clip as WAV at `sampling_rate`. A model whose sample is a
        video says which modality to probe instead (`sample_item` picks an image or audio where the model
        takes one)."""
        import io

        from PIL import Image

        modality, item = self.sample_item()
        buffer = io.BytesIO()
        if isinstance(item, Image.Image):
            item.save(buffer, "PNG")
        elif modality == "audio":
            import numpy as np
            import soundfile

            soundfile.write(buffer, np.asarray(item, dtype=np.float32), int(self.sampling_rate), format="WAV")
        else:
            raise TypeError(f"{type(self).__name__}: no file form for a sample {modality} item "
                            f"({type(item).__name__}); sample_item must give an image or an audio clip")
        return modality, buffer.getvalue()
