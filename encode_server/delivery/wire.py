"""The encoder-to-prefill wire format (docs/CONTRACT.md, section 3), shared by sender and receiver.

One message per request part, two frames: a UTF-8 JSON header and the embedding's raw bytes
(little-endian, row-major; empty when the header carries an error). No pickle anywhere. Models with
deepstack features (Qwen3-VL) add `"deepstack": k` to the header: each row is the main features
followed by k deepstack blocks of the same width; the key is absent (k = 0) for every other model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from encode_server.models.dtypes import PAYLOAD_DTYPES

WIRE_VERSION = 1

HEADER_KEYS = ("v", "req_id", "part_idx", "num_parts", "modality", "dtype", "shape", "items", "error")


class WireError(ValueError):
    """A message that does not follow the wire format."""


@dataclass(frozen=True)
class Header:
    """Frame 0 of a message."""

    req_id: str
    part_idx: int
    num_parts: int
    modality: str
    dtype: str
    shape: tuple[int, int]
    items: list[dict[str, Any]]
    error: dict[str, Any] | None = None
    #: Deepstack blocks after the main features in each row (`[tokens, hidden * (1 + deepstack)]`);
    #: written only when > 0, so the headers of other models stay as they were.
    deepstack: int = 0

    def encode(self) -> bytes:
        header = {
            "v": WIRE_VERSION, "req_id": self.req_id, "part_idx": self.part_idx, "num_parts": self.num_parts,
            "modality": self.modality, "dtype": self.dtype, "shape": list(self.shape), "items": self.items,
            "error": self.error,
        }
        if self.deepstack > 0:
            header["deepstack"] = self.deepstack
        return orjson.dumps(header)

    @property
    def payload_bytes(self) -> int:
        if self.error is not None:
            return 0
        return int(self.shape[0]) * int(self.shape[1]) * PAYLOAD_DTYPES[self.dtype].itemsize


def decode_header(frame: bytes) -> Header:
    """Parse and check frame 0."""
    try:
        data = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != WIRE_VERSION:
        raise WireError(f"unsupported header version {data.get('v') if isinstance(data, dict) else data!r}")
    missing = [key for key in HEADER_KEYS if key not in data]
    if missing:
        raise WireError(f"header lacks {', '.join(missing)}")
    shape = data["shape"]
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise WireError(f"bad shape {shape!r}")
    if data["dtype"] not in PAYLOAD_DTYPES and data["error"] is None:
        raise WireError(f"unknown dtype {data['dtype']!r}")
    if not (isinstance(data["part_idx"], int) and isinstance(data["num_parts"], int)
            and 0 <= data["part_idx"] < data["num_parts"]):
        raise WireError(f"bad part {data['part_idx']!r} of {data['num_parts']!r}")
    deepstack = data.get("deepstack", 0)
    if not (isinstance(deepstack, int) and not isinstance(deepstack, bool) and deepstack >= 0):
        raise WireError(f"bad deepstack {deepstack!r}")
    if data["error"] is None and shape[1] % (1 + deepstack):
        raise WireError(f"rows of width {shape[1]} do not split into 1 + {deepstack} deepstack blocks")
    return Header(req_id=str(data["req_id"]), part_idx=data["part_idx"], num_parts=data["num_parts"],
                  modality=str(data["modality"]), dtype=str(data["dtype"]), shape=(shape[0], shape[1]),
                  items=list(data["items"] or []), error=data["error"], deepstack=deepstack)


def is_wildcard_host(host: str) -> bool:
    """Addresses that mean 'every interface' and must never be connected to or advertised."""
    return host.strip("[]") in ("0.0.0.0", "::", "*", "")
