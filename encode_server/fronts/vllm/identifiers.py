"""vLLM's multimodal item identifiers (`mm_hash`), computed as vLLM 0.33 computes them, without vLLM.

A vLLM consumer looks an item up in the encoder-cache storage under its `mm_hash`
(`vllm/multimodal/processing/inputs.py`, `get_mm_hashes`): the content part's `uuid` verbatim when the
client gave one, else `MultiModalHasher.hash_kwargs(algorithm, model_id=<the consumer's --model>,
image=<the item>)` (`vllm/multimodal/hasher.py`). That hash feeds the digest a framed stream: every
chunk preceded by its length (8 bytes, little-endian), every value by a tag (none, sequence, mapping,
leaf), keys sorted at the top level. What is hashed for each modality:

- an image loaded from bytes: those original bytes, or `{"io_config": {...}, "data": bytes}` when vLLM
  had to convert it (`images.py` says when);
- a video: the pair its loader returns, `(frames with their original bytes, metadata)`: the bytes (or
  the frames array, when it is the smaller) under the key "video", then the metadata dict
  (`video.py`);
- an audio clip: the waveform array its data parser hands the processor (dtype, shape, bytes), after
  resampling to the model's rate (`audio.py`).

Only what identifies our items is written here (strings, bytes, numbers, lists, dicts, numpy arrays,
images and videos as above); `tests/golden/vllm-0.33.0-identifiers.json` holds identifiers that vLLM
itself computed, and a test checks these against them (`scripts/vllm_golden.py` regenerates them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

#: `--ec-hash-algorithm`, as vLLM's `--mm-hasher-algorithm`.
ALGORITHMS = ("blake3", "sha256", "sha512")

_LENGTH_BYTES = 8
_TAG_NONE = b"\x00"
_TAG_SEQUENCE = b"\x01"
_TAG_MAPPING = b"\x02"
_TAG_LEAF = b"\x03"


@dataclass(frozen=True)
class EncodedImage:
    """An image as vLLM hashes one it loaded from bytes: the original file bytes, and the decode settings
    that changed its pixels (`image_mode`, `rgba_background_color`) when vLLM converted it, else None."""

    data: bytes
    io_config: dict[str, Any] | None = None


@dataclass(frozen=True, eq=False)
class EncodedVideo:
    """A video as vLLM hashes one its loader returned: `(MediaWithBytes(frames, original_bytes), metadata)`."""

    original_bytes: bytes
    frames: np.ndarray
    metadata: dict[str, Any]


def _hasher(algorithm: str) -> Callable[[], Any]:
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3
    if algorithm == "sha256":
        return hashlib.sha256
    if algorithm == "sha512":
        return hashlib.sha512
    raise ValueError(f"unsupported hash algorithm {algorithm!r}: use one of {', '.join(ALGORITHMS)}")


@dataclass(frozen=True, eq=False)
class _VideoMedia:
    video: EncodedVideo


def _length(value: int) -> bytes:
    return value.to_bytes(_LENGTH_BYTES, "little")


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield _length(len(chunk))
    yield chunk


def _serialize(obj: Any) -> Iterator[bytes]:
    """vLLM's `MultiModalHasher.serialize_item`, for the types our identifiers hold."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        yield from _framed(bytes(obj))
    elif isinstance(obj, str):
        yield from _framed(obj.encode("utf-8"))
    elif isinstance(obj, (int, float)):  # bool too: numpy's own byte forms, as vLLM writes them
        yield from _framed(np.array(obj).tobytes())
    elif isinstance(obj, np.ndarray):  # vLLM: {"dtype", "shape", "data"} under the key "ndarray"
        data = obj.item() if obj.ndim == 0 else obj.tobytes()
        yield from _key_value("ndarray", {"dtype": obj.dtype.str, "shape": tuple(obj.shape), "data": data})
    elif isinstance(obj, _VideoMedia):  # MediaWithBytes(frames, bytes): whichever is smaller
        video = obj.video
        smaller = video.frames if video.frames.nbytes < len(video.original_bytes) else video.original_bytes
        yield from _key_value("video", smaller)
    elif isinstance(obj, EncodedImage):
        if obj.io_config:
            yield from _key_value("image", {"io_config": obj.io_config, "data": obj.data})
        else:
            yield from _key_value("image", obj.data)
    else:
        raise TypeError(f"no vLLM serialization for {type(obj).__name__}")


def _value(obj: Any) -> Iterator[bytes]:
    """vLLM's `iter_value_to_bytes`: a tag for the container kind, lengths for containers."""
    if obj is None:
        yield _TAG_NONE
    elif isinstance(obj, EncodedVideo):  # the (media, metadata) pair
        yield from _value((_VideoMedia(obj), obj.metadata))
    elif isinstance(obj, (list, tuple)):
        yield _TAG_SEQUENCE
        yield _length(len(obj))
        for element in obj:
            yield from _value(element)
    elif isinstance(obj, dict):
        yield _TAG_MAPPING
        yield _length(len(obj))
        for key, element in obj.items():
            yield from _framed(str(key).encode("utf-8"))
            yield from _value(element)
    else:
        yield _TAG_LEAF
        yield from _serialize(obj)


def _key_value(key: str, obj: Any) -> Iterator[bytes]:
    """vLLM's `iter_item_to_bytes`."""
    yield from _framed(key.encode("utf-8"))
    yield from _value(obj)


def hash_kwargs(algorithm: str, /, **kwargs: Any) -> str:
    """vLLM's `MultiModalHasher.hash_kwargs`: the hex digest of the framed, key-sorted arguments."""
    hasher = _hasher(algorithm)()
    for key, value in sorted(kwargs.items(), key=lambda item: item[0]):
        for chunk in _key_value(key, value):
            hasher.update(chunk)
    return hasher.hexdigest()


def item_identifier(algorithm: str, model_id: str, modality: str, item: Any, uuid: str | None = None) -> str:
    """An item's `mm_hash` in a vLLM consumer started with `--model model_id` and no media or processor
    kwargs: the client's `uuid` as it is, else the hash of the model id and the item."""
    if uuid is not None:
        return uuid
    return hash_kwargs(algorithm, model_id=model_id, **{modality: item})


def video_identifier(algorithm: str, model_id: str, video: EncodedVideo, uuid: str | None = None) -> str:
    """The `mm_hash` of a video part that vLLM's loader decoded into `video`."""
    return item_identifier(algorithm, model_id, "video", video, uuid)


def audio_identifier(algorithm: str, model_id: str, samples: np.ndarray, uuid: str | None = None) -> str:
    """The `mm_hash` of an audio part whose waveform, as vLLM's parser resampled it, is `samples`."""
    return item_identifier(algorithm, model_id, "audio", samples, uuid)


def image_identifier(algorithm: str, model_id: str, image: EncodedImage, uuid: str | None = None) -> str:
    """The `mm_hash` of an image part that vLLM loaded from `image.data`."""
    return item_identifier(algorithm, model_id, "image", image, uuid)
