"""Videos decoded as vLLM 0.32 and 0.33 decode them (`versions.py`: where the two differ), for the vLLM producer.

vLLM's consumer runs its processor on the frames its media loader samples and reads our rows in place
of its encoder's, so ours must come from the same frames, and be filed under the identifier its hasher
computes from what that loader returns. Its loader (`vllm/multimodal/media/video.py`, `VideoMediaIO`,
and `vllm/multimodal/video.py`):

- a `video_url` part's bytes (a `data:` URL's payload or an http(s) body) are opened with OpenCV
  (`cv2.VideoCapture` on the bytes, its stream-buffered FFmpeg backend); the source's frame count and
  rate are read from the container (`CAP_PROP_FRAME_COUNT`, `CAP_PROP_FPS`);
- which frames are kept depends on the model's video processor class (vLLM's `VIDEO_LOADER_REGISTRY`):
  `Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL, the Qwen Omni thinkers): `total / fps * 2` frames,
  clamped to 4..768 and floored to a multiple of 2, indices `torch.arange(0, total, total / n)`;
  `Qwen3VLVideoProcessor`: `int(total / fps * 2)` frames, clamped to 4..768, `linspace(...).round()`;
  `Glm4vVideoProcessor`: 2 per second up to 300 s (`opencv_dynamic`); any other class without a
  loader of its own: 32 frames spread evenly (`num_frames=32`); classes with another loader of their
  own (GLM-5-Next, GLM-4.6V, MiniMax-M3, Muse Spark, Molmo2, ...) are refused (`UnsupportedVideoLoader`);
- the frames are read in order (`grab`, then `retrieve` for the kept ones) and turned BGR to RGB;
- a `data:video/jpeg;base64,<frame>,<frame>,...` URL is a list of JPEG frames instead (the first 32,
  each decoded as an image), taken as sampled at 1 frame per second.

The loader returns the frames (`[T, H, W, 3]` uint8) with a metadata dict (`total_num_frames`, `fps`,
`duration`, `video_backend`, `frames_indices`, `do_sample_frames`), and vLLM hashes the pair: the
original bytes (or the frames, when those are smaller) and the metadata
(`identifiers.EncodedVideo`). OpenCV is what decodes, as in vLLM: the `vllm` extra installs it
(`pip install -e '.[vllm]'` from a checkout, or `pip install opencv-python-headless`); the pixels are the
consumer's only when both sides run the same OpenCV build.
"""

from __future__ import annotations

import binascii
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from encode_server.fronts.vllm.images import decode_vllm_image
from encode_server.media import base64_codec as base64
from encode_server.media.decoding import MediaError

#: vLLM's `VideoMediaIO` default `num_frames` (also the cap on a `video/jpeg` frame list).
DEFAULT_NUM_FRAMES = 32

#: Video processor classes -> the vLLM video loader that samples their videos (`VIDEO_LOADER_REGISTRY`).
LOADER_OF_PROCESSOR = {
    "Qwen2VLVideoProcessor": "qwen2_vl",
    "Qwen3VLVideoProcessor": "qwen3_vl",
    "Cosmos3EdgeVideoProcessor": "qwen3_vl",
    "Glm4vVideoProcessor": "opencv_dynamic",
    # Loaders of their own that this producer does not implement:
    "EmbeddingGemma2VideoProcessor": "embedding_gemma2",
    "Glm46VVideoProcessor": "glm46v",
    "Glm5NextVideoProcessor": "glm5_next",
    "Glm5nextVideoProcessor": "glm5_next",
    "GlmgaVideoProcessor": "glmga",
    "Molmo2VideoProcessor": "molmo2",
    "LlavaOnevision2VideoProcessor": "llava_onevision2",
    "MiniMaxM3VLVideoProcessor": "minimax_m3_vl",
    "MuseSparkVideoProcessor": "muse_spark",
}
#: The loaders implemented here; `opencv` is vLLM's default for every other class.
IMPLEMENTED_LOADERS = ("opencv", "qwen2_vl", "qwen3_vl", "opencv_dynamic")


class UnsupportedVideoLoader(ValueError):
    """The model's videos are sampled by a vLLM loader this producer does not implement."""


@dataclass(frozen=True)
class VllmVideo:
    """A video as vLLM's loader leaves it: the sampled RGB frames, the metadata it returns with them, and
    the bytes it hashes (the file, or a `video/jpeg` URL's base64 text)."""

    frames: np.ndarray  # [T, H, W, 3] uint8
    metadata: dict[str, Any]
    original_bytes: bytes

    def images(self) -> list:
        """Each frame as an RGB image, as the native decode gives a video's frames."""
        from PIL import Image

        return [Image.fromarray(frame) for frame in self.frames]

    def png_frames(self) -> list[bytes]:
        """Each frame as a lossless PNG, for the native path's `{"frames": [...]}` form."""
        from PIL import Image

        out = []
        for frame in self.frames:
            buffer = io.BytesIO()
            Image.fromarray(frame).save(buffer, "PNG", compress_level=1)
            out.append(buffer.getvalue())
        return out


def video_processor_name(folder: str | None, model_type: str | None) -> str | None:
    """The video processor class vLLM picks its loader by (`get_video_processor_cls_name_from_config`):
    `video_processor_type` of the folder's `video_preprocessor_config.json` or `preprocessor_config.json`,
    else `transformers`' video processor for the model type."""
    if folder is not None and Path(folder).is_dir():
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = Path(folder) / name
            try:
                settings = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(settings, dict) and "video_processor_type" in settings:
                return settings["video_processor_type"]
        try:
            model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type", model_type)
        except (OSError, ValueError, AttributeError):
            pass
    if model_type is None:
        return None
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    name = VIDEO_PROCESSOR_MAPPING_NAMES.get(model_type)
    if isinstance(name, dict):  # transformers >= 5.19: {"torchvision": name}
        name = name.get("torchvision")
    return name


def loader_for(processor_name: str | None) -> str:
    """The vLLM loader for a video processor class; `UnsupportedVideoLoader` for one not implemented here."""
    loader = LOADER_OF_PROCESSOR.get(processor_name or "", "opencv")
    if loader not in IMPLEMENTED_LOADERS:
        raise UnsupportedVideoLoader(
            f"vLLM samples this model's videos ({processor_name}) with its {loader!r} loader, which this producer "
            f"does not implement; run vLLM's own encoder for video_url items")
    return loader


# --- which frames ------------------------------------------------------------------------------------


def _prepare_source(loader: str, total: int, fps: float, duration: float) -> tuple[int, float, float]:
    if loader == "qwen3_vl" and not fps > 0:
        return total, 24.0, duration  # HF's Qwen3VLVideoProcessor assumes a 24 fps source
    if loader == "opencv_dynamic" and not duration:
        duration = round((total - 1) / fps) + 1 if fps > 0 else 0
    return total, fps, duration


def frames_to_sample(loader: str, total: int, fps: float, duration: float) -> list[int]:
    """vLLM's `compute_frames_index_to_sample` of each implemented loader, at its default settings."""
    if loader == "qwen2_vl":  # Qwen2VLVideoBackend: fps 2, 4..768 frames, a multiple of 2
        import torch

        if fps <= 0:
            raise ValueError("Qwen2-VL video sampling needs a known source fps, but the container reported 0 "
                             "(variable or unknown frame rate)")
        most = math.floor(min(768, total) / 2) * 2
        count = total / fps * 2
        count = math.floor(min(max(count, 4), most, total) / 2) * 2
        if count == 0:
            raise ValueError(f"vLLM's Qwen2-VL video loader cannot sample a video of {total} frame(s) (it takes "
                             f"frames in pairs)")
        indices = torch.arange(0, total, total / count).int()
        return torch.clamp(indices, max=total - 1).tolist()
    if loader == "qwen3_vl":  # Qwen3VLVideoBackend: fps 2, 4..768 frames
        count = min(max(int(total / fps * 2), 4), 768, total)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()
    if loader == "opencv_dynamic":  # DynamicVideoBackend: fps 2 up to 300 s
        last = total - 1
        if duration <= 300:
            return sorted({min(last, int(math.ceil(i * fps / 2))) for i in range(int(math.floor(duration * 2)))})
        samples = int(300 * 2)
        if samples >= total:
            return list(range(total))
        return sorted({min(last, int(math.ceil(t * fps))) for t in np.linspace(0, duration, samples, endpoint=True)})
    # VideoBackend ("opencv"): num_frames 32, no fps bound
    count = max(1, min(DEFAULT_NUM_FRAMES, total))
    if count == total:
        return list(range(count))
    return np.linspace(0, total - 1, count, dtype=int).tolist()


# --- decoding ----------------------------------------------------------------------------------------


def _cv2(location: str):
    try:
        import cv2
        import cv2.videoio_registry
    except ImportError:
        raise MediaError(location, "video_url items need OpenCV, which vLLM decodes videos with, and the server's "
                                   "environment lacks it: install it there (pip install opencv-python-headless; "
                                   "from a checkout, pip install -e '.[vllm]')") from None
    return cv2


def _stream_api(cv2) -> int | None:
    """vLLM's `get_cv2_video_api`: the first stream-buffered backend OpenCV has."""
    registry = cv2.videoio_registry
    for backend in registry.getStreamBufferedBackends():
        if not registry.hasBackend(backend):
            continue
        if not registry.isBackendBuiltIn(backend):
            _, abi, api = registry.getStreamBufferedBackendPluginVersion(backend)
            if abi < 1 or (abi == 1 and api < 2):
                continue
        return backend
    return None


class _Capture:
    """A `cv2.VideoCapture` on in-memory bytes that keeps its stream alive until it is released (OpenCV's
    Python binding does not own the stream: freeing it first crashes the process)."""

    def __init__(self, cv2, data: bytes, location: str, *params: int) -> None:
        self.stream = io.BytesIO(data)
        self.capture = cv2.VideoCapture(self.stream, _stream_api(cv2), list(params))
        if not self.capture.isOpened():
            self.capture.release()
            raise MediaError(location, "not a decodable video file (OpenCV could not open the stream)")

    def __enter__(self):
        return self.capture

    def __exit__(self, *exc_info) -> None:
        self.capture.release()


def _source_metadata(cv2, data: bytes, location: str, demux_count: bool = True) -> tuple[int, float, float]:
    """vLLM's `OpenCVVideoBackendMixin.get_video_metadata`: frame count, rate and duration (`demux_count` False:
    vLLM 0.32's, which cannot count a stream whose header gives no frame count)."""
    with _Capture(cv2, data, location) as capture:
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = capture.get(cv2.CAP_PROP_FPS)
        if total <= 0 and not demux_count:
            raise MediaError(location, "the video's header gives no frame count (a streamed WebM/MKV or raw H.264), "
                                       "which vLLM 0.32's loader cannot sample (0.33 counts the frames by demuxing): "
                                       "send an MP4 or AVI, or run consumers of vLLM 0.33")
        if total <= 0:  # streamed WebM/MKV, raw H.264: count by demuxing
            with _Capture(cv2, data, location, cv2.CAP_PROP_FORMAT, -1) as demux:
                total = 0
                while demux.grab():
                    total += 1
            if total == 0:
                raise MediaError(location, "could not determine the number of video frames")
            return total, fps, total / fps if fps > 0 else 0
        if capture.set(cv2.CAP_PROP_POS_AVI_RATIO, 1.0):  # an mp4 edit list may hide a decode lead-in
            visible = int(capture.get(cv2.CAP_PROP_POS_FRAMES))
            at_end = not capture.grab()
            capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
            if at_end and 0 < visible < total - 1:
                total = visible
        return total, fps, total / fps if fps > 0 else 0


def decode_vllm_video(data: bytes, loader: str, max_pixels: int, max_frames: int, location: str,
                      demux_count: bool = True) -> VllmVideo:
    """A video file's frames and metadata as vLLM's loader `loader` returns them (OpenCV, no frame recovery);
    `demux_count` False: as vLLM 0.32's loader reads the frame count (`versions.py`)."""
    if not data:
        raise MediaError(location, "empty video data")
    cv2 = _cv2(location)
    with _Capture(cv2, data, location) as capture:
        return _read(cv2, capture, data, loader, max_pixels, max_frames, location, demux_count)


def _read(cv2, capture, data: bytes, loader: str, max_pixels: int, max_frames: int, location: str,
          demux_count: bool = True) -> VllmVideo:
    width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    if width * height > max_pixels:
        raise MediaError(location, f"video frames of {width}x{height} pixels are above the limit of {max_pixels} "
                                   f"(--max-image-pixels)")
    total, fps, duration = _prepare_source(loader, *_source_metadata(cv2, data, location, demux_count))
    try:
        wanted = frames_to_sample(loader, total, fps, duration)
    except (ValueError, ZeroDivisionError) as exc:
        raise MediaError(location, str(exc)) from None
    if not wanted:
        raise MediaError(location, "vLLM's loader samples no frame from this video (too short)")
    if len(set(wanted)) > max_frames:
        raise MediaError(location, f"vLLM samples {len(set(wanted))} frames from this video, above the limit of "
                                   f"{max_frames} (--max-video-frames)")
    targets = set(wanted)
    frames = np.empty((len(targets), height, width, 3), dtype=np.uint8)
    valid: list[int] = []
    for index in range(max(wanted) + 1):  # vLLM's _read_frames_no_recovery
        if not capture.grab():
            continue
        if index in targets:
            ok, frame = capture.retrieve()
            if ok:
                frames[len(valid)] = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                valid.append(index)
    if not valid:
        raise MediaError(location, "the video has no decodable frames")
    metadata = {"total_num_frames": total, "fps": fps, "duration": duration,
                "video_backend": "opencv_dynamic" if loader == "opencv_dynamic" else "opencv",
                "frames_indices": valid, "do_sample_frames": len(valid) == total}
    return VllmVideo(frames[:len(valid)], metadata, data)


def decode_vllm_jpeg_frames(payload: str, max_pixels: int, location: str) -> VllmVideo:
    """A `data:video/jpeg;base64,<frame>,<frame>,...` URL's payload as `VideoMediaIO.load_base64` reads it:
    the first 32 frames, each an image decoded as vLLM decodes images, at 1 frame per second."""
    parts = payload.split(",", DEFAULT_NUM_FRAMES)[:DEFAULT_NUM_FRAMES]
    images = []
    for index, part in enumerate(parts):
        try:
            data = base64.b64decode(part, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"{location} frame {index}", f"not valid base64 ({exc})") from None
        images.append(np.asarray(decode_vllm_image(data, max_pixels, f"{location} frame {index}").image))
    if len({image.shape for image in images}) != 1:
        raise MediaError(location, "the video/jpeg frames differ in size (vLLM stacks them into one array)")
    frames = np.stack(images)
    total = int(frames.shape[0])
    metadata = {"total_num_frames": total, "fps": 1.0, "duration": total / 1.0, "video_backend": "jpeg_sequence",
                "frames_indices": list(range(total)), "do_sample_frames": False}
    return VllmVideo(frames, metadata, payload.encode())
