"""`--wire-format native` as the sender writes it (docs/CONTRACT.md section 3): the header of `wire`, then
the embedding's raw bytes. The delivery's `WireFormat` for our own receiver."""

from __future__ import annotations

from encode_server.delivery.destinations import Frames
from encode_server.delivery.wire import Header
from encode_server.models import EncoderAdapter
from encode_server.models.dtypes import DTYPE_NAMES, raw_bytes
from encode_server.records import EncodedPart, PartMeta


class NativeWire:
    """Frame 0 a UTF-8 JSON header, frame 1 the embedding's raw little-endian bytes (empty on error)."""

    def __init__(self, adapter: EncoderAdapter) -> None:
        self._dtype = DTYPE_NAMES[adapter.dtype]
        self._info = adapter.info

    def header(self, meta: PartMeta, part: EncodedPart | None, error: dict | None = None) -> Header:
        return Header(
            req_id=meta.req_id, part_idx=meta.part_idx, num_parts=meta.num_parts, modality=meta.modality,
            dtype=DTYPE_NAMES[part.embedding.dtype] if part is not None else self._dtype,
            shape=tuple(part.embedding.shape) if part is not None else (0, self._info.row_width_of(meta.modality)),
            items=part.items_json() if part is not None else [],
            error=error, deepstack=self._info.deepstack_of(meta.modality),
        )

    def success_frames(self, meta: PartMeta, part: EncodedPart) -> Frames:
        return [self.header(meta, part).encode(), raw_bytes(part.embedding)]

    def failure_frames(self, meta: PartMeta, status: int, message: str) -> Frames:
        return [self.header(meta, None, {"code": status, "message": message}).encode(), b""]
