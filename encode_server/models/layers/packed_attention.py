"""Packed attention for the Qwen-grid vision towers: every window of a batch in a few calls, not one call each.

The towers of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4V attend within segments of one packed row
sequence (`cu_seqlens`: each image, or each 8x8-patch window in Qwen2.5-VL's windowed blocks); so do the
audio towers of Qwen2.5-Omni and Qwen3-Omni (each chunk or attention window of each clip). Unless a
flash-attention implementation is configured, `transformers` splits the sequence and calls SDPA once per
segment: a batch of large images has hundreds of windows or more, so each windowed block makes as many
small calls, launch-bound on a GPU and a Python loop on a CPU. Configured with `PACKED_ATTENTION` (its name holds
"flash", which makes `transformers` hand over `cu_seqlens` instead of looping), the tower calls
`packed_attention` once per block, which runs

- one SDPA call per distinct segment length, the segments of that length gathered into one batch (an
  image's windows come in four lengths at most), with exactly the loop's rows;
- or, where `use_varlen` is set, on CUDA in half precision: `torch.nn.attention.varlen.varlen_attn` (flash
  attention over the packed sequence, one kernel for every segment; see `use_varlen`).

Each segment sees exactly its own rows, as in the loop; the values differ from it by float rounding only.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
import torch.nn.functional as F

#: The attention implementation name the adapters set on their tower's config.
PACKED_ATTENTION = "flash_packed_segments"

try:  # torch >= 2.9 on CUDA builds
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_TAKES_SCALE = "scale" in inspect.signature(_varlen_attn).parameters
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn, _VARLEN_TAKES_SCALE = None, False

#: Whether `packed_attention` may use `varlen_attn` on CUDA. Off by default: its rows differ from `transformers`'
#: loop in bfloat16 where the grouped SDPA calls match it exactly, and whether that is only another kernel's
#: rounding is not settled, so the exact path is the default.
use_varlen = False


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                     max_length_q: int | None = None, max_length_k: int | None = None, is_causal: bool = False,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Bidirectional attention within each segment `cu_seq_lens_q` marks. `query`, `key`, `value`:
    `(1, heads, rows, head_dim)`; returns `((1, rows, heads, head_dim), None)` as the flash interfaces do."""
    if attention_mask is not None or is_causal or dropout or cu_seq_lens_q is None or \
            (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("packed_attention handles bidirectional self-attention within cu_seqlens segments only")
    head_dim = query.shape[-1]
    scale = head_dim ** -0.5 if scaling is None else scaling
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # (rows, heads, head_dim) views
    if _varlen_usable(q):
        out = _varlen(q, k, v, cu_seq_lens_q, max_length_q, scale)
    else:
        out = _grouped_sdpa(q, k, v, cu_seq_lens_q, scale)
    return out.unsqueeze(0), None


def _varlen_usable(q: torch.Tensor) -> bool:
    return use_varlen and _varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_length: int | None,
            scale: float) -> torch.Tensor:
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int(max_length) if max_length is not None else int((cu[1:] - cu[:-1]).max())
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if _VARLEN_TAKES_SCALE:
        return _varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale)
    if abs(scale - q.shape[-1] ** -0.5) > 1e-12:  # older torch: only the default scale, so fold ours into q
        q = q * (scale * q.shape[-1] ** 0.5)
    return _varlen_attn(q, k, v, cu, cu, longest, longest)


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One SDPA call per distinct segment length: the segments of a length gathered into one batch."""
    bounds = cu_seqlens.tolist()
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            starts_by_length[end - start].append(start)
    out = torch.empty_like(q)
    for length, starts in starts_by_length.items():
        if len(starts) == 1:
            rows = slice(starts[0], starts[0] + length)
            attended = _sdpa(q[rows].unsqueeze(0), k[rows].unsqueeze(0), v[rows].unsqueeze(0), scale)
            out[rows] = attended[0]
            continue
        index = (torch.tensor(starts, device=q.device)[:, None] +
                 torch.arange(length, device=q.device)).reshape(-1)
        segments = [t.index_select(0, index).view(len(starts), length, *t.shape[1:]) for t in (q, k, v)]
        attended = _sdpa(*segments, scale)
        out.index_copy_(0, index, attended.reshape(-1, *q.shape[1:]))
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA on `(batch, rows, heads, head_dim)`, answered in that layout."""
    attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return attended.transpose(1, 2)


def register() -> str:
    """Make `PACKED_ATTENTION` known to `transformers` (idempotent) and return the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    return PACKED_ATTENTION


def use_packed_attention(tower: torch.nn.Module, blocks: str = "blocks", attention: str = "attn") -> bool:
    """Configure a Qwen-grid tower (its blocks' `attn` read `config._attn_implementation`) to attend with
    `packed_attention`; False, and nothing changed, if its blocks are not of that kind. The Omni audio towers,
    which attend within `cu_seqlens` chunks alike, name theirs: `blocks="layers", attention="self_attn"`."""
    config = getattr(tower, "config", None)
    layers = getattr(tower, blocks, None)
    if config is None or not layers or \
            any(getattr(getattr(layer, attention, None), "config", None) is not config for layer in layers):
        return False
    config._attn_implementation = register()
    return True


def use_packed_attention_in_layers(tower: torch.nn.Module, attention: str) -> bool:
    """`use_packed_attention` for towers whose blocks are `layers` with the attention module named `attention`
    (Kimi K2.5's `attn`, MiniMax-M3's `self_attn`), all reading the tower's config; False, nothing changed, else."""
    config = getattr(tower, "config", None)
    layers = getattr(tower, "layers", None)
    if config is None or not layers or \
            any(getattr(getattr(layer, attention, None), "config", None) is not config for layer in layers):
        return False
    config._attn_implementation = register()
    return True
