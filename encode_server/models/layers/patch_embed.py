"""Patch embeddings of Qwen-grid towers as one matrix multiply instead of a Conv3d.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4V embed each patch row (`C x T x P x P` values) with
`Conv3d(kernel_size == stride)`: the kernel covers the whole input, so the convolution is exactly
`rows @ weight.view(out, -1).T + bias`, which runs faster as that matrix multiply than as torch's general
3-D convolution, with the same values up to float rounding (summation order). The module keeps its Conv3d
parameters (names, sharding, checkpoints unchanged); only its `forward` is replaced, and only when the
convolution is exactly that shape.

The embedding also takes the pixel rows of a batch's items as separate tensors (`forward_items` of the
Qwen-grid adapters, fed by the preprocessing pool): the tower's forward hands its pixels to the patch
embedding before anything else reads them, so a batch's float32 pixel rows, its largest tensors, are never
concatenated; only the embedded rows are.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


def _as_matmul(self: torch.nn.Module, hidden_states: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The patch rows embedded; given a sequence of row tensors (one per item), each is embedded on its own
    and only the (much narrower) results are concatenated, so the pixels are never copied into one tensor."""
    proj = self.proj
    weight = proj.weight
    matrix = weight.reshape(weight.shape[0], -1)
    parts = [hidden_states] if isinstance(hidden_states, torch.Tensor) else list(hidden_states)
    embedded = [F.linear(part.reshape(-1, matrix.shape[1]).to(dtype=weight.dtype), matrix, proj.bias)
                for part in parts]
    return (embedded[0] if len(embedded) == 1 else torch.cat(embedded)).view(-1, self.embed_dim)


def patches_as_matmul(patch_embed: torch.nn.Module) -> bool:
    """Make a Qwen-grid `patch_embed` module (its `proj` a Conv3d whose kernel equals its stride, no
    padding, dilation or groups) embed by matrix multiply; False, and nothing changed, for any other."""
    proj = getattr(patch_embed, "proj", None)
    if not isinstance(proj, torch.nn.Conv3d) or not hasattr(patch_embed, "embed_dim"):
        return False
    if tuple(proj.kernel_size) != tuple(proj.stride) or any(proj.padding) or proj.groups != 1 or \
            any(d != 1 for d in proj.dilation) or proj.out_channels != patch_embed.embed_dim:
        return False
    patch_embed.forward = types.MethodType(_as_matmul, patch_embed)
    return True


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """The rows in host memory; from a GPU through page-locked memory, which copies several times faster
    than to pageable memory and comes from torch's caching host allocator, so a batch's buffer is reused
    once freed."""
    if rows.device.type != "cuda":
        return rows.to("cpu").contiguous()
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows)
    return host


class ItemPixelsForward:
    """`forward` and `forward_items` of the Qwen-grid adapters. In `forward_items`, each item's pixel rows go
    to the tower as they are (see `_as_matmul`), only the small grids are concatenated. The adapter sets
    `embeds_parts` (what `patches_as_matmul` answered) and gives `tower_rows(pixels, grid, modality)`."""

    embeds_parts = False

    def tower_rows(self, pixels: Any, grid: torch.Tensor, modality: str) -> torch.Tensor:
        raise NotImplementedError

    def _on_device(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.to(device=self.device, dtype=self.dtype, non_blocking=True)

    @torch.inference_mode()
    def forward(self, batch: Any) -> torch.Tensor:
        grid = batch.inputs["grid_thw"].to(self.device)
        rows = self.tower_rows(self._on_device(batch.inputs["pixel_values"]), grid, batch.modality)
        return to_host(rows)

    @torch.inference_mode()
    def forward_items(self, batches: Sequence[Any]) -> tuple[list[Any], torch.Tensor]:
        if not self.embeds_parts or len(batches) < 2 or \
                any(set(batch.inputs) != {"pixel_values", "grid_thw"} for batch in batches):
            return super().forward_items(batches)  # type: ignore[misc]
        pixels = [self._on_device(batch.inputs["pixel_values"]) for batch in batches]
        grid = torch.cat([batch.inputs["grid_thw"] for batch in batches]).to(self.device)
        rows = self.tower_rows(pixels, grid, batches[0].modality)
        return [layout for batch in batches for layout in batch.layouts], to_host(rows)
