"""Decode one media item's bytes, with the limits that guard it: CPU work, no I/O, no asyncio.

Images (EXIF orientation applied as `transformers.image_utils.load_image` does), audio (soundfile,
resampled with librosa, mono), video files (PyAV, sampled at `video_fps`) and videos given as image
frames. A video comes back as a `VideoClip` (`processors/video_clip.py`): its frames and where they
sit in the source (the stream's frame rate and each frame's index in it; frames given as images are
taken as sampled at `video_fps`, frame i at i / video_fps seconds). Every failure is a `MediaError`
naming the item. Used by the server's media threads, the
preprocessing workers and the tensor- and data-parallel ranks alike.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from processors.video_clip import VideoClip

#: PIL's own bomb guard stays on as a second line; ours (`max_image_pixels`) runs first.
Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, 200_000_000)


class MediaError(ValueError):
    """An item that cannot be used; `location` names it, e.g. `mm_items[2]`."""

    def __init__(self, location: str, message: str) -> None:
        super().__init__(f"{location}: {message}")
        self.location = location
        self.message = message


def decode_image(data: bytes, max_pixels: int, location: str, header_only: bool = False) -> Image.Image:
    """An RGB image, refusing images larger than `max_pixels` from their header alone.

    Decoded as `transformers.image_utils.load_image` does: turned upright by its EXIF orientation
    (`ImageOps.exif_transpose`), then converted to RGB, so the grid is the one the prefill side sees.

    `header_only`: the image as opened (size and mode known, pixels not decoded yet), for when the
    pixels are decoded elsewhere (the preprocessing pool's workers) and only the layout is needed here;
    an image whose EXIF orientation swaps its sides is still decoded, so that its size is the upright one.
    """
    return finish_image(open_image(data, max_pixels, location), location, header_only)


def open_image(data: bytes, max_pixels: int, location: str) -> Image.Image:
    """`decode_image`'s first half: the image opened from its header (size known, pixels not decoded),
    refused above `max_pixels`."""
    if not data:
        raise MediaError(location, "empty image data")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise MediaError(location, f"image too large for PIL's decompression-bomb guard: {exc}") from None
    except UnidentifiedImageError:
        raise MediaError(location, "not a decodable image (unknown or corrupt format)") from None
    except Exception as exc:  # PIL raises many types for malformed headers
        raise MediaError(location, f"cannot read image header: {exc}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaError(location, f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise MediaError(
            location, f"image is {width}x{height} = {width * height} pixels, above the limit of {max_pixels} "
                      f"(--max-image-pixels)"
        )
    return image


def finish_image(image: Image.Image, location: str, header_only: bool = False) -> Image.Image:
    """`decode_image`'s second half, on what `open_image` gave."""
    if header_only and image.getexif().get(0x0112, 1) not in (5, 6, 7, 8):  # 0x0112: Orientation
        return image
    try:
        image.load()
        if image.getexif().get(0x0112, 1) in (2, 3, 4, 5, 6, 7, 8):  # what exif_transpose turns; else it copies
            image = ImageOps.exif_transpose(image)
        return image if image.mode == "RGB" else image.convert("RGB")  # convert() copies an RGB image too
    except Exception as exc:
        raise MediaError(location, f"cannot decode image: {exc}") from None


def decode_audio(data: bytes, sample_rate: int, max_seconds: float, location: str) -> np.ndarray:
    """A mono float32 waveform at `sample_rate`, refusing clips over `max_seconds` from the header."""
    import librosa
    import soundfile

    if not data:
        raise MediaError(location, "empty audio data")
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:
        raise MediaError(location, "not a decodable audio file (WAV, FLAC or OGG expected)") from None
    if info.samplerate <= 0 or info.frames <= 0:
        raise MediaError(location, "audio has no samples")
    duration = info.frames / info.samplerate
    if duration > max_seconds:
        raise MediaError(location, f"audio of {duration:.2f} s is longer than the limit of {max_seconds:g} s "
                                   f"(--max-audio-seconds; or send it as several shorter clips)")
    try:
        wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:
        raise MediaError(location, f"cannot decode audio: {exc}") from None
    mono = wave.mean(axis=1)
    if rate != sample_rate:
        mono = librosa.resample(mono, orig_sr=rate, target_sr=sample_rate)
    if not np.isfinite(mono).all():
        raise MediaError(location, "audio holds NaN or infinite samples")
    return np.ascontiguousarray(mono, dtype=np.float32)


def decode_video(data: bytes, fps: float, max_frames: int, max_pixels: int, location: str) -> VideoClip:
    """Frames of a video file sampled at `fps` (at most `max_frames`, spread evenly), decoded with PyAV.

    The clip says where its frames sit as `transformers`' PyAV reader would: the stream's average
    frame rate, and each frame's index in decoding order (a stream that gives no rate: `fps` and
    0, 1, 2, ..., as for frames sent as images)."""
    try:
        import av
    except ImportError:
        raise MediaError(location, "video files need PyAV, which the server's environment lacks: install it there "
                                   "(pip install av; from a checkout, pip install -e '.[video]'), or send "
                                   "{\"frames\": [...]} (the video's frames as images) instead") from None
    try:
        container = av.open(io.BytesIO(data))
    except Exception:
        raise MediaError(location, "not a decodable video file") from None
    with container:
        if not container.streams.video:
            raise MediaError(location, "the file has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > max_pixels:
            raise MediaError(location, f"video frames of {width}x{height} pixels are above the limit of {max_pixels} "
                                       f"(--max-image-pixels)")
        duration = None
        if stream.duration is not None and stream.time_base is not None:
            duration = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            duration = container.duration / 1_000_000
        if duration and duration > 0:
            count = max(1, min(max_frames, int(np.ceil(duration * fps))))
            targets = [index * duration / count for index in range(count)]
        else:
            targets = [index / fps for index in range(max_frames)]
        rate = stream.average_rate or stream.guessed_rate
        frames: list[Image.Image] = []
        indices: list[int] = []
        try:
            for index, frame in enumerate(container.decode(stream)):
                if len(frames) >= len(targets):
                    break
                when = float(frame.time) if frame.time is not None else len(frames) / fps
                if when + 1e-6 >= targets[len(frames)]:
                    frames.append(frame.to_image().convert("RGB"))
                    indices.append(index)
        except Exception as exc:
            if not frames:
                raise MediaError(location, f"cannot decode video: {exc}") from None
    if not frames:
        raise MediaError(location, "the video has no decodable frames")
    if not rate or rate <= 0:
        return VideoClip(frames, fps, range(len(frames)))
    return VideoClip(frames, float(rate), indices)


@dataclass(frozen=True)
class MediaLimits:
    """What decoding may accept and produce (from the settings: `MediaLimits.from_settings`)."""

    max_image_pixels: int
    max_fetch_bytes: int
    audio_sample_rate: int
    max_audio_seconds: float
    video_fps: float
    max_video_frames: int
    allow_private_urls: bool
    allowed_local_media_dir: str | None
    extra_allowed_networks: tuple = ()  # tests only: loopback networks treated as public

    @classmethod
    def from_settings(cls, settings: Any, adapter: Any) -> MediaLimits:
        """The limits of a server's `Settings`, audio resampled to the rate of the adapter's processor (16 kHz
        without an adapter)."""
        return cls(
            max_image_pixels=settings.max_image_pixels, max_fetch_bytes=settings.max_request_bytes,
            audio_sample_rate=16000 if adapter is None else adapter.processor.sampling_rate,
            max_audio_seconds=settings.max_audio_seconds, video_fps=settings.video_fps,
            max_video_frames=settings.max_video_frames, allow_private_urls=settings.allow_private_urls,
            allowed_local_media_dir=settings.allowed_local_media_dir,
        )


def decode_bytes(modality: str, data: bytes, limits: MediaLimits, location: str, header_only: bool = False) -> Any:
    """One item's file bytes decoded for `modality` (an image, a waveform, or a video's frames);
    `header_only`: images are only opened (see `decode_image`)."""
    if modality == "image":
        return decode_image(data, limits.max_image_pixels, location, header_only)
    if modality == "audio":
        return decode_audio(data, limits.audio_sample_rate, limits.max_audio_seconds, location)
    return decode_video(data, limits.video_fps, limits.max_video_frames, limits.max_image_pixels, location)


def decode_frames(frames: list[bytes], limits: MediaLimits, location: str,
                  header_only: bool = False) -> VideoClip:
    """A video given as a list of image files: frame i taken as sampled at i / `video_fps` seconds."""
    images = [decode_image(data, limits.max_image_pixels, f"{location}.frames[{index}]", header_only)
              for index, data in enumerate(frames)]
    return VideoClip(images, limits.video_fps, range(len(images)))
