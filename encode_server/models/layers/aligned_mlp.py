"""Vision MLPs widened to an aligned hidden width with zero weights: the same function, faster GPU matmuls.

Qwen2.5-VL's vision blocks (every published size) have an MLP width of 3,420, which is not a multiple of
8: the gate and up projections' outputs and the down projection's input then have a row length the fast
bfloat16 kernels of cuBLAS cannot take, so those matrix multiplies fall back to older, slower kernels.

`align_mlp_widths` pads such a width (one that is not a multiple of 8; Qwen3-VL's 4,304 and GLM-4V's
13,696 are left alone) up to a multiple of 64: the first linear(s) get zero output rows
(zero bias), the last one zero input columns. A padded unit's output is multiplied by a zero column,
so it adds exact zeros whatever the activation makes of it; the MLP computes the same function, up to
the summation order the faster kernels choose. Parameter names stay; their shapes grow, so it runs
after the checkpoint is loaded, and the adapters call it on CUDA only (CPU kernels do not care).
Tensor-parallel sharding splits the padded width like any other (64 divides evenly by 2, 4, 8...).
"""

from __future__ import annotations

import torch

#: Whether the adapters pad on CUDA (benchmarks switch it off to compare).
enabled = True

#: MLP layouts of the Qwen-grid towers: (linears into the hidden width, the linear out of it).
MLP_LAYOUTS = ((("gate_proj", "up_proj"), "down_proj"), (("fc1",), "fc2"), (("linear_fc1",), "linear_fc2"))


def _grow(linear: torch.nn.Linear, dim: int, width: int) -> None:
    """Zero-pad `linear`'s weight along `dim` (0: output features, 1: input features) to `width`."""
    weight = linear.weight.detach()
    shape = list(weight.shape)
    shape[dim] = width
    grown = weight.new_zeros(shape)
    grown.narrow(dim, 0, weight.shape[dim]).copy_(weight)
    linear.weight = torch.nn.Parameter(grown, requires_grad=False)
    if dim == 0:
        linear.out_features = width
        if linear.bias is not None:
            bias = linear.bias.detach()
            linear.bias = torch.nn.Parameter(torch.cat([bias, bias.new_zeros(width - bias.shape[0])]),
                                             requires_grad=False)
    else:
        linear.in_features = width


def align_mlp_widths(tower: torch.nn.Module, multiple: int = 64, needed: int = 8) -> int:
    """Pad every MLP of `tower` whose hidden width is not a multiple of `needed` (what the fast bf16 kernels
    need) up to a multiple of `multiple`; returns how many."""
    padded = 0
    for module in tower.modules():
        for inputs, output in MLP_LAYOUTS:
            linears = [getattr(module, name, None) for name in (*inputs, output)]
            if not all(isinstance(linear, torch.nn.Linear) for linear in linears):
                continue
            *into, out_of = linears
            width = out_of.in_features
            if width % needed == 0 or any(linear.out_features != width for linear in into):
                continue
            aligned = -(-width // multiple) * multiple
            with torch.no_grad():
                for linear in into:
                    _grow(linear, 0, aligned)
                _grow(out_of, 1, aligned)
            padded += 1
    return padded
