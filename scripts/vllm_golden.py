"""Identifiers and decoded pixels that vLLM 0.33.0 itself computes for the committed images in
`tests/golden/vllm-images/`, so CI (which has no vLLM) can check ours against them.

Run in the side venv of `scripts/vllm_compat.sh`, from the repository root:

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python scripts/vllm_golden.py generate   # writes the JSON
    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python scripts/vllm_golden.py check      # compares, no writing

`generate` first (re)makes the tiny images (an RGB PNG, a transparent RGBA PNG, a palette PNG with a
tRNS chunk, a grayscale PNG, an EXIF-rotated JPEG, a CMYK JPEG), then loads each one with vLLM's
`ImageMediaIO.load_bytes` (its media loader's decode) and identifies it with vLLM's
`ProcessorInputs.get_mm_hashes` (for two model ids and the three `--mm-hasher-algorithm`s, and with a
client uuid), and writes `tests/golden/vllm-0.33.0-identifiers.json`: per image the identifiers, the
`io_config` vLLM hashed with the bytes, and the size and SHA-256 of the RGB pixels vLLM decoded.
`tests/test_vllm_identifiers.py` asserts that `delivery.vllm_hash` and `media.vllm_images` agree.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "tests" / "golden" / "vllm-images"
OUTPUT = ROOT / "tests" / "golden" / "vllm-0.33.0-identifiers.json"
MODEL_IDS = ("Qwen/Qwen2.5-VL-3B-Instruct", "/models/Qwen3-VL-8B-Instruct")
ALGORITHMS = ("blake3", "sha256", "sha512")
UUID = "user-item-0001"


def make_images() -> dict[str, bytes]:
    """Tiny images, one per decode path vLLM takes (a few hundred bytes each)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images: dict[str, bytes] = {}

    def save(name: str, image: Image.Image, fmt: str, **kwargs) -> None:
        buffer = io.BytesIO()
        image.save(buffer, fmt, **kwargs)
        images[name] = buffer.getvalue()

    save("rgb.png", Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)), "PNG")
    rgba = rng.integers(0, 256, (7, 5, 4), dtype=np.uint8)
    rgba[..., 3] = np.linspace(0, 255, 35).reshape(7, 5).astype(np.uint8)
    save("rgba.png", Image.fromarray(rgba, "RGBA"), "PNG")
    palette = Image.fromarray(rng.integers(0, 4, (6, 6), dtype=np.uint8), "P")
    palette.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 250, 250, 10] + [0] * 756)
    save("palette_trns.png", palette, "PNG", transparency=2)
    save("gray.png", Image.fromarray(rng.integers(0, 256, (5, 9), dtype=np.uint8), "L"), "PNG")
    exif = Image.Exif()
    exif[0x0112] = 6
    save("exif6.jpg", Image.fromarray(rng.integers(0, 256, (8, 16, 3), dtype=np.uint8)), "JPEG", quality=90,
         exif=exif.tobytes())
    save("cmyk.jpg", Image.fromarray(rng.integers(0, 256, (8, 8, 4), dtype=np.uint8), "CMYK"), "JPEG", quality=90)
    return images


def vllm_reference(images: dict[str, bytes]) -> dict:
    import numpy as np
    import vllm
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    result: dict = {"_produced_by": f"scripts/vllm_golden.py generate with vLLM {vllm.__version__}",
                    "model_ids": list(MODEL_IDS), "algorithms": list(ALGORITHMS), "uuid": UUID, "images": {}}
    parser = MultiModalDataParser()
    for name, data in sorted(images.items()):
        loaded = ImageMediaIO().load_bytes(data)
        pixels = np.ascontiguousarray(np.asarray(loaded.media))
        entry = {"size": list(loaded.media.size), "mode": loaded.media.mode,
                 "io_config": loaded.io_config and {k: list(v) if isinstance(v, tuple) else v
                                                    for k, v in loaded.io_config.items()},
                 "pixels_sha256": hashlib.sha256(pixels.tobytes()).hexdigest(), "identifiers": {}}
        items = parser.parse_mm_data({"image": [loaded]})
        for algorithm in ALGORITHMS:
            entry["identifiers"][algorithm] = {
                model_id: ProcessorInputs([], items).get_mm_hashes(model_id, algorithm)["image"][0]
                for model_id in MODEL_IDS}
        with_uuid = ProcessorInputs([], items, {"image": [UUID]}).get_mm_hashes(MODEL_IDS[0], "blake3")
        entry["with_uuid"] = with_uuid["image"][0]
        result["images"][name] = entry
    return result


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "check"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if command == "generate":
        IMAGES.mkdir(parents=True, exist_ok=True)
        for name, data in make_images().items():
            (IMAGES / name).write_bytes(data)
    images = {path.name: path.read_bytes() for path in sorted(IMAGES.iterdir())}
    reference = vllm_reference(images)
    if command == "generate":
        OUTPUT.write_text(json.dumps(reference, indent=1) + "\n")
        print(f"wrote {OUTPUT.relative_to(ROOT)} for {len(images)} images")
        return 0
    stored = json.loads(OUTPUT.read_text())
    same = {key: stored[key] for key in ("images",)} == {key: reference[key] for key in ("images",)}
    print("golden identifiers match vLLM" if same else "golden identifiers DIFFER from vLLM: regenerate")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
