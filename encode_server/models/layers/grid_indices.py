"""The index tensors of a Qwen2-VL or Qwen2.5-VL vision tower, computed once per grid and joined per batch.

Before its layers, the tower derives for every item of a batch its rotary position ids and (Qwen2.5-VL) the
order and bounds of its attention windows, in a Python loop of about 25 small torch calls per item: for a
batch of 32 small images, over 800 of the forward's ~1,370 operator calls, each a trip through torch's
dispatcher and a release of the GIL. They depend on the item's `(t, h, w)` grid alone, so `GridIndices`
computes them once per distinct grid, with transformers' own functions on that grid alone, and joins them
for a batch in a handful of calls. The tower takes them as the precomputed arguments its forward accepts
(`position_ids`, `window_index`, `cu_window_seqlens`): the values are exactly those it would compute.

Joining: the position ids of a batch are its items' ids one after another; an item's window order is
offset by the merged rows of the items before it; the window bounds are each item's bounds offset by the
patches before it, with the repeats (empty windows, item boundaries) removed, as the tower removes them.
"""

from __future__ import annotations

import functools
import weakref
from itertools import accumulate
from typing import Any

import torch

#: Distinct grids remembered per tower (a few hundred bytes each).
CACHED_GRIDS = 4096

#: The towers whose forward takes these precomputed arguments, by class name.
_TOWERS = frozenset({"Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel"})


class GridIndices:
    """Precomputed index arguments for one tower (see the module's docstring)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.merge = int(tower.spatial_merge_size)
        self.windowed = hasattr(tower, "window_size") and hasattr(tower, "fullatt_block_indexes")
        self.window_size = int(getattr(tower, "window_size", 0))
        self.patch_size = int(getattr(tower, "patch_size", 0))
        self._one = functools.lru_cache(maxsize=CACHED_GRIDS)(self._compute_one)

    def _compute_one(self, t: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

        grid = torch.tensor([[t, h, w]], device=device)
        position_ids = get_vision_position_ids(grid, self.merge)
        if not self.windowed:
            return (position_ids,)
        window_index, cu_window_seqlens = get_vision_window_index(
            grid, spatial_merge_size=self.merge, window_size=self.window_size, patch_size=self.patch_size)
        return position_ids, window_index, cu_window_seqlens

    def arguments(self, grid: torch.Tensor) -> dict[str, Any]:
        """The tower's precomputed arguments for a batch of `grid` (`[items, 3]`)."""
        shapes = [tuple(int(n) for n in row) for row in grid.tolist()]
        parts = [self._one(t, h, w, grid.device) for t, h, w in shapes]
        if len(parts) == 1:
            return dict(zip(self._names(), parts[0]))
        arguments = {"position_ids": torch.cat([part[0] for part in parts])}
        if self.windowed:
            patches = [t * h * w for t, h, w in shapes]
            merged = [count // (self.merge * self.merge) for count in patches]
            arguments["window_index"] = _offset_join([part[1] for part in parts], merged)
            bounds = _offset_join([part[2] for part in parts], patches)
            arguments["cu_window_seqlens"] = torch.unique_consecutive(bounds)
        return arguments

    def _names(self) -> tuple[str, ...]:
        return ("position_ids", "window_index", "cu_window_seqlens") if self.windowed else ("position_ids",)


def _offset_join(pieces: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """`pieces` one after another, each offset by the sum of `sizes` before it."""
    offsets = torch.tensor([0, *accumulate(sizes[:-1])], dtype=pieces[0].dtype, device=pieces[0].device)
    lengths = torch.tensor([piece.shape[0] for piece in pieces], device=pieces[0].device)
    return torch.cat(pieces) + torch.repeat_interleave(offsets, lengths)


_BY_TOWER: weakref.WeakKeyDictionary[torch.nn.Module, GridIndices | None] = weakref.WeakKeyDictionary()


def grid_arguments(tower: torch.nn.Module, grid: torch.Tensor) -> dict[str, Any]:
    """The precomputed index arguments for `tower` on `grid`; none for a tower that does not take them."""
    indices = _BY_TOWER.get(tower, False)
    if indices is False:
        indices = _BY_TOWER[tower] = GridIndices(tower) if type(tower).__name__ in _TOWERS else None
    return indices.arguments(grid) if indices is not None else {}
