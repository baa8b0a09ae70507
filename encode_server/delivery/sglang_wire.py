"""SGLang's encoder-to-prefill frames, written without importing SGLang (it is not a dependency).

SGLang's prefill side (`MMReceiverHTTP`, `WaitingZmqRequest`, 0.5.12 and later) reads frame 0 of
every ZMQ message with `pickle`/`safe_pickle_loads` as its own `EmbeddingData`, and frame 1 as the
embedding's raw bytes (`torch.frombuffer(frame, dtype=obj.dtype).reshape(obj.shape)`):

- success: two frames, `[pickle(EmbeddingData without its tensor), raw little-endian row-major bytes]`;
- failure: one frame, the object with `error_msg` and `error_code` set and `grid_dim`, `dtype`,
  `shape` None, so every prefill rank that gets it fails the request at once.

The object's state is exactly what SGLang 0.5.21+'s encoder pickles (`EmbeddingData(...,
**aux).copy_without_embedding()`), in the same order: `req_id, num_parts, part_idx, grid_dim,
modality, embedding, send_time, dtype, shape, _mr_ptr, error_msg, error_code` and, on success,
`video_timestamps, second_per_grid_ts`. `grid_dim` is an int64 tensor: `[n_items, 3]` (t, h, w)
grids for images and videos, `[n_items]` lengths for audio: mel frames, or rows where the model's
language side reads those (each layout's `receiver_grid` overrides the default: Muse Spark's merged
token grids and audio rows). `video_timestamps`, for a model whose layouts time each video's temporal
patches or clips, is one list of seconds (plain floats, as SGLang's encoder sends them) per video, else
None: the layouts' own `video_timestamps` (Qwen3-VL, Qwen3.5: each patch's seconds, which SGLang's
processor writes into the prompt as `<t seconds>`), or their `clip_frames` over `--video-fps` (Muse
Spark). SGLang's receiver chains the parts' lists. `modality` is SGLang's `Modality` enum (IMAGE=1,
VIDEO=2, AUDIO=3). `send_time` is the wall-clock time the frame was made (SGLang's own encoder leaves
it None; its receivers only copy it).

The pickle (protocol 4) is produced by Python's own pickler, byte for byte as SGLang's would be
(tests/golden/ holds frames pickled by real SGLang): two stand-in classes are written under SGLang's
class paths instead of their own, and torch writes its tensors and dtypes itself (most of a pickle's cost is torch
pickling the grid tensor: hence the templates below). Only classes on SGLang's unpickling
allowlist appear in it. This module only ever writes pickles; nothing received is unpickled anywhere
in the server.
"""

from __future__ import annotations

import io
import pickle
import struct
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: importing this module stays cheap
    import torch

    from encode_server.records import EncodedPart, PartMeta

from encode_server.ops.setting_values import check_class_path

#: Where `EmbeddingData` lives in SGLang 0.5.21 and later (the default of `--sglang-embedding-class`).
EMBEDDING_CLASS = "sglang.srt.disaggregation.encoder.receiver.EmbeddingData"
#: Where it lived in SGLang 0.5.12 to 0.5.18.
LEGACY_EMBEDDING_CLASS = "sglang.srt.disaggregation.encode_receiver.EmbeddingData"
#: SGLang's `Modality` enum: defined here up to 0.5.21, re-exported from here since (and on every
#: version's unpickling allowlist; 0.5.23 defines it in `sglang.srt.multimodal.modality`).
MODALITY_CLASS = "sglang.srt.managers.schedule_batch.Modality"
#: `Modality` member values by our modality names.
MODALITY_VALUES = {"image": 1, "video": 2, "audio": 3}

PROTOCOL = 4
class _EmbeddingDataStandIn:
    """Pickled as `copyreg.__newobj__(cls)` plus its `__dict__`, as any plain object is."""


class _ModalityClassStandIn:
    """Written as SGLang's `Modality` class."""


# A module-name string of its own (equal, not identical, to this module's `__name__`), so the C pickler
# writes and memoizes it afresh as it would SGLang's distinct module name, instead of reusing the
# EmbeddingData stand-in's: memo indices then match SGLang's pickle one for one.
_ModalityClassStandIn.__module__ = ".".join(__name__.split("."))


class _ModalityMember:
    """Pickled as `Modality(value)`, as `Enum.__reduce_ex__` writes a member."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _ModalityClassStandIn, (self.value,)


class _PathPickler(pickle._Pickler):
    """Python's pickler, writing the stand-in classes under configured `module.Class` paths.

    The C pickler cannot be told to name a class that is not importable; the Python one is its
    reference implementation (same opcodes, memo and framing), so only `save_global` differs here.
    """

    def __init__(self, file: io.BytesIO, class_paths: dict[type, tuple[str, str]]) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self._class_paths = class_paths

    def save_global(self, obj: Any, name: str | None = None) -> None:
        path = self._class_paths.get(obj) if isinstance(obj, type) else None
        if path is None:
            super().save_global(obj, name)
            return
        module, qualname = path
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def grid_tensor(grids: Sequence[Any] | torch.Tensor) -> torch.Tensor:
    """`grid_dim` as SGLang's receiver expects it: a contiguous int64 tensor ([n, 3] or [n])."""
    import torch

    if isinstance(grids, torch.Tensor):
        return grids.detach().to("cpu", torch.int64).contiguous().clone()
    return torch.tensor([list(g) if isinstance(g, (tuple, list)) else int(g) for g in grids], dtype=torch.int64)


def _global_opcodes(module: str, qualname: str) -> bytes:
    """How protocol 4 writes a class met for the first time: two memoized strings and STACK_GLOBAL."""
    out = bytearray()
    for text in (module, qualname):
        raw = text.encode("utf-8")
        out += (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little")) + raw
        out += pickle.MEMOIZE
    return bytes(out + pickle.STACK_GLOBAL + pickle.MEMOIZE)


_FAST_PATH_MAX_FRAME = 60_000  # the picklers split frames at 64 KiB; bigger messages take the reference path

#: Placeholders pickled where a template's request id and send time go (built afresh: never an interned string).
_REQ_ID_MARK = "".join(["\x00encode-server:", "req-id\x00"])
_SEND_TIME_MARK = -1.2345678901234567e-300
#: Templates kept per `SglangFrames` (the oldest is dropped beyond this: kinds of message, not messages).
TEMPLATES_KEPT = 512


def _string_op(text: str) -> bytes:
    """How protocol 4 writes a str (SHORT_BINUNICODE or BINUNICODE); UnicodeEncodeError for lone surrogates,
    which the pickler writes with `surrogatepass` (the caller then takes the pickler)."""
    raw = text.encode("utf-8")
    return (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little")) + raw


class _Template:
    """A success header's pickle cut where its request id and send time go."""

    def __init__(self, data: bytes) -> None:
        body = data[11:]
        id_op, time_op = _string_op(_REQ_ID_MARK), b"G" + struct.pack(">d", _SEND_TIME_MARK)
        if data[2:3] != pickle.FRAME or body.count(id_op) != 1 or body.count(time_op) != 1 or \
                body.find(id_op) > body.find(time_op):
            raise ValueError("not a one-frame header with one request id before one send time")
        self.protocol = data[:2]
        before, after = body.split(id_op)
        self.before = before
        self.between, self.after = after.split(time_op)

    def fill(self, req_id: str, send_time: float) -> bytes | None:
        try:
            id_op = _string_op(req_id)
        except UnicodeEncodeError:
            return None
        body = b"".join((self.before, id_op, self.between, b"G", struct.pack(">d", send_time), self.after))
        if len(body) > _FAST_PATH_MAX_FRAME:
            return None
        return self.protocol + pickle.FRAME + len(body).to_bytes(8, "little") + body


class SglangFrames:
    """Makes frame 0 of SGLang's messages for one configured pair of class paths.

    Fast path: the C pickler writes the stand-ins under their own (importable) names, and those two
    class references, whose positions and opcodes are fixed, are swapped for SGLang's paths (the one
    frame's length adjusted). It gives the same bytes as the reference path, `_PathPickler`, which
    is used for messages too big for one pickle frame; tests compare the two.
    """

    def __init__(self, embedding_class: str = EMBEDDING_CLASS, modality_class: str = MODALITY_CLASS) -> None:
        self.embedding_class = check_class_path(embedding_class)
        self.modality_class = check_class_path(modality_class)
        self._class_paths = {
            _EmbeddingDataStandIn: tuple(self.embedding_class.rsplit(".", 1)),
            _ModalityClassStandIn: tuple(self.modality_class.rsplit(".", 1)),
        }
        self._swaps = [(_global_opcodes(cls.__module__, cls.__qualname__), _global_opcodes(*path))
                       for cls, path in self._class_paths.items()]
        self._templates: dict[tuple, _Template | None] = {}

    def _dumps(self, state: dict[str, Any]) -> bytes:
        obj = _EmbeddingDataStandIn()
        obj.__dict__.update(state)
        fast = self._retarget(pickle.dumps(obj, protocol=PROTOCOL))
        return fast if fast is not None else self._reference_dumps(obj)

    def _reference_dumps(self, obj: _EmbeddingDataStandIn) -> bytes:
        buffer = io.BytesIO()
        _PathPickler(buffer, self._class_paths).dump(obj)
        return buffer.getvalue()

    def _retarget(self, data: bytes) -> bytes | None:
        """`data` with the stand-ins' class references renamed, or None when it is not one frame.

        The EmbeddingData reference opens the body; the Modality one is the first occurrence of its
        opcodes, which no earlier value can contain (a string is UTF-8, where the MEMOIZE byte 0x94
        never follows an ASCII letter; a grid tensor's bytes hold small integers)."""
        (embedding_old, embedding_new), (modality_old, modality_new) = self._swaps
        if data[2:3] != pickle.FRAME or int.from_bytes(data[3:11], "little") != len(data) - 11:
            return None
        body = data[11:]
        if not body.startswith(embedding_old):
            return None
        at = body.find(modality_old)
        if at < 0:
            return None
        body = embedding_new + body[len(embedding_old):at] + modality_new + body[at + len(modality_old):]
        if len(body) > _FAST_PATH_MAX_FRAME:
            return None
        return data[:2] + pickle.FRAME + len(body).to_bytes(8, "little") + body

    def embedding_header(self, *, req_id: str, part_idx: int, num_parts: int, modality: str,
                         grids: Sequence[Any] | torch.Tensor, dtype: torch.dtype, shape: Sequence[int],
                         second_per_grid_ts: Sequence[float] | None = None,
                         video_timestamps: list[Any] | None = None, send_time: float | None = None) -> bytes:
        """Frame 0 of a success message (frame 1: the embedding's raw bytes, `shape` of `dtype`)."""
        import torch

        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        req_id, send_time = str(req_id), time.time() if send_time is None else float(send_time)
        key = _template_key(part_idx, num_parts, modality, grids, dtype, shape, second_per_grid_ts, video_timestamps)
        if key is not None:
            template = self._templates.get(key, False)
            if template is False:
                template = self._template(key, part_idx=part_idx, num_parts=num_parts, modality=modality, grids=grids,
                                          dtype=dtype, shape=shape, second_per_grid_ts=second_per_grid_ts,
                                          video_timestamps=video_timestamps)
            frame = template.fill(req_id, send_time) if template is not None else None
            if frame is not None:
                return frame
        return self._embedding_dumps(req_id=req_id, part_idx=part_idx, num_parts=num_parts, modality=modality,
                                     grids=grids, dtype=dtype, shape=shape, second_per_grid_ts=second_per_grid_ts,
                                     video_timestamps=video_timestamps, send_time=send_time)

    def _template(self, key: tuple, **fields: Any) -> _Template | None:
        """The template for one kind of message, made and kept (None: this kind takes the pickler)."""
        try:
            template = _Template(self._embedding_dumps(req_id=_REQ_ID_MARK, send_time=_SEND_TIME_MARK, **fields))
        except ValueError:
            template = None
        if len(self._templates) >= TEMPLATES_KEPT:
            del self._templates[next(iter(self._templates))]
        self._templates[key] = template
        return template

    def _embedding_dumps(self, *, req_id: str, part_idx: int, num_parts: int, modality: str,
                         grids: Sequence[Any] | torch.Tensor, dtype: torch.dtype, shape: Sequence[int],
                         second_per_grid_ts: Sequence[float] | None, video_timestamps: list[Any] | None,
                         send_time: float) -> bytes:
        import torch

        return self._dumps({
            "req_id": req_id,
            "num_parts": int(num_parts),
            "part_idx": int(part_idx),
            "grid_dim": grid_tensor(grids),
            "modality": _ModalityMember(MODALITY_VALUES[modality]),
            "embedding": None,
            "send_time": send_time,
            "dtype": dtype,
            "shape": [int(n) for n in shape],
            "_mr_ptr": None,
            "error_msg": None,
            "error_code": None,
            "video_timestamps": video_timestamps,
            "second_per_grid_ts": (None if second_per_grid_ts is None
                                   else torch.tensor([float(s) for s in second_per_grid_ts], dtype=torch.float32)),
        })

    def error_header(self, *, req_id: str, part_idx: int, num_parts: int, modality: str, message: str,
                     code: int, send_time: float | None = None) -> bytes:
        """The single frame of a failure message."""
        return self._dumps({
            "req_id": str(req_id),
            "num_parts": int(num_parts),
            "part_idx": int(part_idx),
            "grid_dim": None,
            "modality": _ModalityMember(MODALITY_VALUES[modality]),
            "embedding": None,
            "send_time": time.time() if send_time is None else float(send_time),
            "dtype": None,
            "shape": None,
            "_mr_ptr": None,
            "error_msg": str(message),
            "error_code": int(code),
        })


def _template_key(part_idx: int, num_parts: int, modality: str, grids: Any, dtype: Any, shape: Sequence[int],
                  seconds: Sequence[float] | None, timestamps: list[Any] | None) -> tuple | None:
    """What makes two success headers differ besides their request id and send time; None (no template) for
    grids given as a tensor."""
    if not isinstance(grids, (list, tuple)):
        return None
    try:
        return (int(part_idx), int(num_parts), modality, dtype, tuple(int(n) for n in shape),
                tuple(tuple(int(n) for n in grid) if isinstance(grid, (list, tuple)) else int(grid) for grid in grids),
                None if seconds is None else tuple(float(s) for s in seconds),
                None if timestamps is None else tuple(None if stamp is None else tuple(float(t) for t in stamp)
                                                      for stamp in timestamps))
    except (TypeError, ValueError):
        return None


def receiver_grid(modality: str, layout: Any) -> Any:
    """One item's `grid_dim` entry: its layout's `receiver_grid` if set, else the audio clip's mel frames or
    the image's or video's `grid_thw`."""
    if layout.receiver_grid is not None:
        return layout.receiver_grid
    if modality != "audio":
        return layout.grid_thw
    if layout.mel_frames is None:
        raise ValueError("this model's audio layouts do not say their mel-frame lengths")
    return layout.mel_frames


def video_timestamps(layouts: Sequence[Any], fps: float | None) -> list[list[float]] | None:
    """Each video's timestamps in seconds, one list per item, as SGLang's encoder sends them: the layout's
    `video_timestamps` (Qwen3-VL, Qwen3.5: each temporal patch's seconds), else its `clip_frames` over the
    sampling fps (Muse Spark); None where the model's layouts name neither."""
    stamps = [[float(seconds) for seconds in layout.video_timestamps] if layout.video_timestamps is not None
              else [float(frame) / fps for frame in layout.clip_frames]
              if layout.clip_frames is not None and fps is not None else None
              for layout in layouts]
    if all(stamp is None for stamp in stamps):
        return None
    if any(stamp is None for stamp in stamps):
        raise ValueError("some of this model's video layouts name their timestamps and some do not")
    return stamps


class SglangWire:
    """`--wire-format sglang`: the delivery's `WireFormat` in SGLang's frames.

    `seconds_per_grid_step` is `second_per_grid_ts` for every video item (the temporal patch size over the
    sampling fps, as SGLang's own encoder computes it) for the models whose language side reads it
    (`SECONDS_PER_GRID_FAMILIES`); None for other models.
    `video_timestamps` come from the video items' layouts: each temporal patch's seconds where the model's
    layouts hold them, else the clip frames they name over `video_fps` (`--video-fps`, the rate video items'
    frames are taken at).
    """

    def __init__(self, embedding_class: str = EMBEDDING_CLASS, seconds_per_grid_step: float | None = None,
                 video_fps: float | None = None) -> None:
        self.frames = SglangFrames(embedding_class)
        self.seconds_per_grid_step = seconds_per_grid_step
        self.video_fps = video_fps

    def success_frames(self, meta: PartMeta, part: EncodedPart) -> list[bytes | memoryview]:
        from encode_server.models.dtypes import raw_bytes

        return [self.header(meta, part), raw_bytes(part.embedding)]

    def header(self, meta: PartMeta, part: EncodedPart) -> bytes:
        """Frame 0 of a success message: the part's `EmbeddingData` without its tensor (the single frame of
        SGLang's mooncake backend, whose rows are written into the receiver's buffer instead)."""
        grids = [receiver_grid(meta.modality, layout) for layout in part.layouts]
        seconds = timestamps = None
        if meta.modality == "video":
            if self.seconds_per_grid_step is not None:
                seconds = [self.seconds_per_grid_step] * len(part.layouts)
            timestamps = video_timestamps(part.layouts, self.video_fps)
        return self.frames.embedding_header(
            req_id=meta.req_id, part_idx=meta.part_idx, num_parts=meta.num_parts, modality=meta.modality,
            grids=grids, dtype=part.embedding.dtype, shape=part.embedding.shape, second_per_grid_ts=seconds,
            video_timestamps=timestamps)

    def failure_frames(self, meta: PartMeta, status: int, message: str) -> list[bytes | memoryview]:
        """One frame: SGLang fails the request on `error_msg` before it looks for a payload."""
        return [self.frames.error_header(req_id=meta.req_id, part_idx=meta.part_idx, num_parts=meta.num_parts,
                                         modality=meta.modality, message=message, code=status)]


#: The families whose SGLang language side takes videos' `second_per_grid_ts` (its M-RoPE positions follow
#: time): the model types SGLang's own encoder computes it for (`preprocessor.py`, 0.5.23).
SECONDS_PER_GRID_FAMILIES = ("qwen2_5_vl", "qwen2_5_omni", "qwen3_omni_moe")

def seconds_per_grid_step(adapter: Any, video_fps: float) -> float | None:
    """Seconds per temporal grid step (temporal patch size / sampling fps) for the families that use it; None
    for the others."""
    # A grid family's processor says it (`processors.grid.GridProcessor`).
    temporal_patch_size = getattr(getattr(adapter, "processor", None), "temporal_patch_size", None)
    if getattr(adapter.info, "family", None) not in SECONDS_PER_GRID_FAMILIES or temporal_patch_size is None:
        return None
    return temporal_patch_size / video_fps
