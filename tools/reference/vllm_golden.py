"""Identifiers and decoded media that vLLM 0.33.0 itself computes for the committed images, video clips and
audio clips in `tests/golden/vllm-images/`, `vllm-videos/` and `vllm-audio/`, so CI (which has no vLLM)
can check ours against them.

Run in the side venv of `tools/compat/vllm_compat.sh`, from the repository root:

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python tools/reference/vllm_golden.py generate   # writes the JSON
    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python tools/reference/vllm_golden.py check      # compares, no writing

`generate` first (re)makes the tiny images (an RGB PNG, a transparent RGBA PNG, a palette PNG with a
tRNS chunk, a grayscale PNG, an EXIF-rotated JPEG, a CMYK JPEG), then loads each one with vLLM's
`ImageMediaIO.load_bytes` (its media loader's decode) and identifies it with vLLM's
`ProcessorInputs.get_mm_hashes` (for two model ids and the three `--mm-hasher-algorithm`s, and with a
client uuid), and writes `tests/golden/vllm-0.33.0-identifiers.json`: per image the identifiers, the
`io_config` vLLM hashed with the bytes, and the size and SHA-256 of the RGB pixels vLLM decoded.
`tests/fronts/test_vllm_identifiers.py` asserts that `fronts.vllm.identifiers` and `fronts.vllm.images` agree.

Videos (an MPEG-4 clip, an MJPEG AVI, and a `video/jpeg` frame list): loaded with vLLM's `VideoMediaIO`
through each of the loaders this producer implements (`opencv`, `qwen2_vl`, `qwen3_vl`,
`opencv_dynamic`), then parsed and identified as a consumer does: the sampled frames' SHA-256 and shape,
the metadata, and the identifiers. Audio (a 16 kHz mono WAV, a 44.1 kHz stereo FLAC, a 22.05 kHz WAV):
loaded with `AudioMediaIO`, resampled to 16 kHz by the parser (torchaudio, as vLLM does), identified;
the waveform's SHA-256 and length, and the identifiers.

`versions` (run once by each side venv, `tools/compat/vllm_compat.sh [VERSION]`) adds that vLLM's decode and
identifiers of the images in `tests/golden/vllm-images-versions/` (those the versions decode differently: an RGB
PNG with a tRNS chunk) to `tests/golden/vllm-versions.json`, keyed by the version;
`tests/fronts/test_vllm_versions.py` checks `--ec-vllm-version`'s choices against every version there.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "tests" / "golden" / "vllm-images"
VIDEOS = ROOT / "tests" / "golden" / "vllm-videos"
AUDIO = ROOT / "tests" / "golden" / "vllm-audio"
VIDEO_LOADERS = ("opencv", "qwen2_vl", "qwen3_vl", "opencv_dynamic")
AUDIO_RATE = 16000
OUTPUT = ROOT / "tests" / "golden" / "vllm-0.33.0-identifiers.json"
VERSION_IMAGES = ROOT / "tests" / "golden" / "vllm-images-versions"
VERSIONS_OUTPUT = ROOT / "tests" / "golden" / "vllm-versions.json"
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


def make_videos() -> dict[str, bytes]:
    """Tiny clips (a few kB): 10 noisy frames of 32x24 at 5 fps as MPEG-4 in MP4 and as MJPEG in AVI, and a
    `video/jpeg` frame list (the payload of a data: URL: base64 JPEGs joined by commas)."""
    import base64

    import av
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    frames = [np.clip(np.full((24, 32, 3), 40 * index % 256) + rng.integers(0, 60, (24, 32, 3)), 0, 255)
              .astype(np.uint8) for index in range(10)]
    videos: dict[str, bytes] = {}
    for name, fmt, codec, pix_fmt in (("clip.mp4", "mp4", "mpeg4", "yuv420p"), ("clip.avi", "avi", "mjpeg",
                                                                                 "yuvj420p")):
        buffer = io.BytesIO()
        with av.open(buffer, "w", format=fmt) as container:
            stream = container.add_stream(codec, rate=5)
            stream.width, stream.height, stream.pix_fmt = 32, 24, pix_fmt
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        videos[name] = buffer.getvalue()
    jpegs = []
    for frame in frames[:3]:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, "JPEG", quality=85)
        jpegs.append(base64.b64encode(buffer.getvalue()).decode())
    videos["frames.jpeg.b64"] = ",".join(jpegs).encode()
    return videos


def make_audio() -> dict[str, bytes]:
    """Tiny clips: a 16 kHz mono 16-bit WAV (no resampling), a 44.1 kHz stereo FLAC (channels averaged, then
    resampled), a 22.05 kHz float WAV (resampled)."""
    import numpy as np
    import soundfile

    rng = np.random.default_rng(2)
    clips: dict[str, bytes] = {}
    for name, rate, channels, fmt, subtype, seconds in (("mono16k.wav", 16000, 1, "WAV", "PCM_16", 0.12),
                                                        ("stereo44k.flac", 44100, 2, "FLAC", "PCM_16", 0.1),
                                                        ("float22k.wav", 22050, 1, "WAV", "FLOAT", 0.08)):
        t = np.arange(int(rate * seconds)) / rate
        wave = np.stack([0.4 * np.sin(2 * np.pi * (220 + 110 * c) * t) + 0.02 * rng.standard_normal(t.size)
                         for c in range(channels)], axis=1)
        buffer = io.BytesIO()
        soundfile.write(buffer, wave.astype(np.float32), rate, format=fmt, subtype=subtype)
        clips[name] = buffer.getvalue()
    return clips


def _metadata_json(metadata: dict) -> dict:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in metadata.items()}


def vllm_video_reference(videos: dict[str, bytes]) -> dict:
    import numpy as np
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    result: dict = {}
    for name, data in sorted(videos.items()):
        entry: dict = {}
        for loader in VIDEO_LOADERS if not name.endswith(".b64") else ("jpeg_sequence",):
            io_ = VideoMediaIO(ImageMediaIO(), video_backend=loader if loader != "jpeg_sequence" else "opencv")
            loaded = io_.load_base64("video/jpeg", data.decode()) if loader == "jpeg_sequence" else \
                io_.load_bytes(data)
            frames, metadata = loaded.media
            row = {"shape": list(frames.shape), "frames_sha256": hashlib.sha256(
                np.ascontiguousarray(frames).tobytes()).hexdigest(), "metadata": _metadata_json(metadata),
                "identifiers": {}}
            for needs_metadata in (False, True):  # Qwen2-VL's parser, and Qwen2.5-VL's / Qwen3-VL's
                items = MultiModalDataParser(video_needs_metadata=needs_metadata).parse_mm_data({"video": [loaded]})
                ids = {algorithm: {model_id: ProcessorInputs([], items).get_mm_hashes(model_id, algorithm)["video"][0]
                                   for model_id in MODEL_IDS} for algorithm in ALGORITHMS}
                assert not row["identifiers"] or row["identifiers"] == ids, "parsers disagree"
                row["identifiers"] = ids
            entry[loader] = row
        result[name] = entry
    return result


def vllm_audio_reference(clips: dict[str, bytes]) -> dict:
    import numpy as np
    from vllm.multimodal.media.audio import AudioMediaIO
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    result: dict = {}
    for name, data in sorted(clips.items()):
        loaded = AudioMediaIO().load_bytes(data)
        items = MultiModalDataParser(target_sr=AUDIO_RATE, target_channels=1).parse_mm_data({"audio": [loaded]})
        samples = np.asarray(items["audio"].get(0))
        result[name] = {"native_rate": int(loaded[1]), "samples": int(samples.shape[0]), "dtype": samples.dtype.str,
                        "samples_sha256": hashlib.sha256(np.ascontiguousarray(samples).tobytes()).hexdigest(),
                        "identifiers": {algorithm: {model_id: ProcessorInputs([], items).get_mm_hashes(
                            model_id, algorithm)["audio"][0] for model_id in MODEL_IDS} for algorithm in ALGORITHMS}}
    return result


def vllm_reference(images: dict[str, bytes]) -> dict:
    import numpy as np
    import vllm
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    result: dict = {"_produced_by": f"tools/reference/vllm_golden.py generate with vLLM {vllm.__version__}",
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


def make_version_images() -> dict[str, bytes]:
    """Images vLLM 0.32 and 0.33 decode differently: an RGB PNG whose tRNS chunk names one colour transparent."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    pixels[:6, :5] = (10, 20, 30)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, "PNG", transparency=(10, 20, 30))
    return {"rgb_trns.png": buffer.getvalue()}


def versions() -> int:
    """This vLLM's reference for the images the versions decode differently, merged into VERSIONS_OUTPUT."""
    import vllm

    VERSION_IMAGES.mkdir(parents=True, exist_ok=True)
    for name, data in make_version_images().items():
        if not (VERSION_IMAGES / name).exists():
            (VERSION_IMAGES / name).write_bytes(data)
    images = {path.name: path.read_bytes() for path in sorted(VERSION_IMAGES.iterdir())}
    stored = json.loads(VERSIONS_OUTPUT.read_text()) if VERSIONS_OUTPUT.exists() else {}
    stored[vllm.__version__] = vllm_reference(images)
    VERSIONS_OUTPUT.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
    print(f"wrote vLLM {vllm.__version__}'s reference for {len(images)} images to {VERSIONS_OUTPUT.relative_to(ROOT)}")
    return 0


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "check"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if command == "versions":
        return versions()
    if command == "generate":
        for folder, made in ((IMAGES, make_images()), (VIDEOS, make_videos()), (AUDIO, make_audio())):
            folder.mkdir(parents=True, exist_ok=True)
            for name, data in made.items():
                (folder / name).write_bytes(data)
    images = {path.name: path.read_bytes() for path in sorted(IMAGES.iterdir())}
    reference = vllm_reference(images)
    reference["audio_rate"] = AUDIO_RATE
    reference["videos"] = vllm_video_reference({path.name: path.read_bytes() for path in sorted(VIDEOS.iterdir())})
    reference["audio"] = vllm_audio_reference({path.name: path.read_bytes() for path in sorted(AUDIO.iterdir())})
    if command == "generate":
        OUTPUT.write_text(json.dumps(reference, indent=1) + "\n")
        print(f"wrote {OUTPUT.relative_to(ROOT)} for {len(images)} images, {len(reference['videos'])} videos and "
              f"{len(reference['audio'])} audio clips")
        return 0
    stored = json.loads(OUTPUT.read_text())
    keys = ("images", "videos", "audio")
    same = {key: stored.get(key) for key in keys} == {key: reference[key] for key in keys}
    print("golden identifiers match vLLM" if same else "golden identifiers DIFFER from vLLM: regenerate")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
