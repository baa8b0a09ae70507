"""Parity of the fast (torchvision) image processors against the PIL path, per built-in image family.

For each built-in model with an image processor, the same images go through its PIL processor and
through `DeviceImageProcessor` (the fast twin on `--device`: cuda when available, else cpu) exactly as
the adapter calls it. Token counts (grids, tile counts) must be identical; pixel values may differ by
resampling (torchvision's bicubic/bilinear kernels on tensors against PIL's on uint8 images), and the
script prints the largest absolute difference, the mean one, and whether it is within `--tolerance`
(in normalised pixel units, where one uint8 step is about 0.015 for Qwen's mean/std). Needs torchvision:
run it in a side environment, never in CI:

    .sglang-venv/bin/python tools/reference/gpu_preprocess_parity.py   # the side venv of tools/compat/sglang_compat.sh
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from encode_server.models import load_adapter  # noqa: E402
from encode_server.preprocessing.gpu import DeviceImageProcessor  # noqa: E402

SIZES = [(56, 56), (300, 120), (90, 500), (640, 480), (1280, 720)]


def camera_like(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    x, y = np.linspace(0, 1, width)[None, :, None], np.linspace(0, 1, height)[:, None, None]
    tint = rng.uniform(0, 255, (1, 1, 3))
    pixels = (tint * x + (255 - tint) * y + rng.normal(0, 12, (height, width, 3))).clip(0, 255)
    return Image.fromarray(pixels.astype(np.uint8))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="largest allowed absolute difference of a normalised pixel value")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    images = [camera_like(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    failed = False
    # A checkpoint folder too: where torchvision is installed, `AutoImageProcessor` already gives the
    # torchvision-backend processor, which must serve as its own fast twin (it was refused before).
    from benchmarks.camera import camera_checkpoint

    for name in ("tiny-qwen2.5-vl", "tiny-internvl", "tiny-qwen2-audio", str(camera_checkpoint())):
        adapter = load_adapter(name, "cpu", "float32")
        pil = getattr(adapter, "image_processor", None)
        if pil is None:
            print(f"{name}: no image processor (audio); nothing to run on the GPU")
            continue
        reference = adapter.processor.preprocess("image", images)
        adapter.processor.image_processor = DeviceImageProcessor(pil, device)
        fast = adapter.processor.preprocess("image", images)
        tokens_same = [layout.tokens for layout in reference.layouts] == [layout.tokens for layout in fast.layouts]
        grids_same = reference.layouts == fast.layouts
        ours, theirs = reference.inputs["pixel_values"].float(), fast.inputs["pixel_values"].float().cpu()
        shapes_same = ours.shape == theirs.shape
        diff = (ours - theirs).abs() if shapes_same else torch.tensor([float("inf")])
        within = tokens_same and grids_same and shapes_same and float(diff.max()) <= args.tolerance
        failed |= not within
        print(f"{name}: {type(pil).__name__} vs {type(adapter.processor.image_processor.fast).__name__} on {device}: "
              f"tokens identical {tokens_same}, grids identical {grids_same}, pixel_values {tuple(ours.shape)}; "
              f"max abs diff {float(diff.max()):.4g}, mean abs diff {float(diff.mean()):.3g} "
              f"({'within' if within else 'ABOVE'} {args.tolerance:g})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
