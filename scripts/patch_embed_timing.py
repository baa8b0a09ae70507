"""Conv3d vs matrix-multiply patch embedding (`encode_server/models/layers/patch_embed.py`) on one CPU core.

One 1280x720 image's patches (4,784 rows of 1,176 values) through Qwen2.5-VL's patch embedding at its
real width (1,280) and at the camera benchmark's tiny width (32), in float32 and bfloat16: the time of
each and the largest difference between them.

    THP_MEM_ALLOC_ENABLE=1 python scripts/patch_embed_timing.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from encode_server.models.layers.patch_embed import patches_as_matmul  # noqa: E402


def main() -> None:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = torch.randn(4784, 1176)
    for width in (1280, 32):
        for dtype in (torch.float32, torch.bfloat16):
            embed = Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, in_channels=3,
                                             embed_dim=width).to(dtype)

            def timed(embed: torch.nn.Module = embed) -> tuple[float, torch.Tensor]:
                out = embed(rows)
                started = time.perf_counter()
                for _ in range(3):
                    embed(rows)
                return (time.perf_counter() - started) / 3 * 1e3, out.float()

            conv_ms, reference = timed()
            assert patches_as_matmul(embed)
            matmul_ms, out = timed()
            print(f"width {width:5d} {str(dtype):15s} conv3d {conv_ms:8.1f} ms  matmul {matmul_ms:8.1f} ms  "
                  f"max abs diff {(out - reference).abs().max().item():.1e} (values up to "
                  f"{reference.abs().max().item():.2f})")


if __name__ == "__main__":
    main()
