"""Patch embeddings of Qwen-grid towers as one matrix multiply instead of a Conv3d.

Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4V embed each patch row (`C x T x P x P` values) with
`Conv3d(kernel_size == stride)`: the kernel covers the whole input, so the convolution is exactly
`rows @ weight.view(out, -1).T + bias`, but torch runs it as a general 3-D convolution. The matrix
multiply gives the same values up to float rounding (summation order) and is faster: on one CPU core,
a 1280x720 image (4,784 rows) through the real Qwen2.5-VL embedding (1,176 -> 1,280) took 445 ms as a
Conv3d and 164 ms as a matrix multiply (max abs difference 5e-6 on values up to 3); the tiny camera
tower's 10.5 -> 8.5 ms (`python scripts/patch_embed_timing.py`). The module keeps its Conv3d
parameters (names, sharding, checkpoints unchanged); only its `forward` is replaced, and only when the
convolution is exactly that shape.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _as_matmul(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    proj = self.proj
    weight = proj.weight
    rows = hidden_states.reshape(-1, weight[0].numel()).to(dtype=weight.dtype)
    return F.linear(rows, weight.reshape(weight.shape[0], -1), proj.bias).view(-1, self.embed_dim)


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
