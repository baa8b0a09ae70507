"""The objects of the shared embedding tier in Mooncake Store, laid out as vLLM 0.33 lays them out.

vLLM's cross-encoder cache (`ec_transfer/ec_connector/mooncake_store_embedding/`, key version `v3`) keeps
one object per item:

- **key** `<namespace>@id:<identifier>`, where the namespace is
  `[<prefix>@]embedding@model:<model>@revision:<revision>@encoder:<encoder hash>@dtype:<dtype>@protocol:v3`:
  `prefix` is the connector's `embedding_cache_prefix` (empty: no prefix and no `@`), `model` its
  `embedding_model_identity` (default: the `--model` string), `revision` the model revision or `default`,
  `encoder` the multimodal config's `compute_hash()` (an md5 of its printed encoder factors:
  `[None, 'weights', None, None, True]` with vLLM 0.33.0's defaults), `dtype` the model dtype as torch
  prints it (`torch.bfloat16`);
- **value** a 24-byte little-endian header `<IIQQ` (magic `0x4D4F4F4E`, a dtype code: 0 float32,
  11 float16, 12 bfloat16, the item's rows, the row width) followed by the rows, row-major, nothing after.

An entry of another model, revision, encoder, dtype or protocol has another key: it is never found, so
never served. Within a key, a reader still checks the header against what it expects (magic, dtype,
width) and the object's length against the header (rows x width x element size): anything else is a
corrupt object, a miss (`CorruptObject`), never rows.

Native `/encode` items use the same value format under a namespace of this server's own
(`encode-server@...`, identifier: the embedding cache's content key in hex), with a second object
`<namespace>@layout:<identifier>` holding the item's layout (grid, timestamps) as JSON, which vLLM's
format has no room for. `--ec-storage` items (`fronts.vllm`) use vLLM's namespace and identifiers, so
vLLM encoders and this server answer each other's items.

The protocol marker (`PROTOCOL_MARKER_KEY`) says which protocol a Store's writers speak; a server refuses
to start against a Store whose marker names a protocol it cannot read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: vLLM's key version; also the protocol this server writes and the only one it reads.
PROTOCOL = "v3"
READABLE_PROTOCOLS = frozenset({PROTOCOL})

MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")  # magic, dtype code, rows, width
DTYPE_CODES = {torch.float32: 0, torch.float16: 11, torch.bfloat16: 12}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

#: The object that names the Store's protocol (JSON: {"protocol": "v3", "writer": ...}).
PROTOCOL_MARKER_KEY = "encode-server@store-protocol"

#: vLLM 0.33.0's `MultiModalConfig.compute_hash()` with its defaults: md5 of the printed list of the factors
#: (`mm_encoder_attn_backend` name, `mm_encoder_tp_mode`, `mm_encoder_attn_dtype`, `mm_encoder_fp8_scale_path`,
#: `mm_device_do_normalize`).
VLLM_DEFAULT_ENCODER_FACTORS = [None, "weights", None, None, True]
VLLM_DEFAULT_ENCODER_HASH = hashlib.md5(str(VLLM_DEFAULT_ENCODER_FACTORS).encode(), usedforsecurity=False).hexdigest()


class CorruptObject(ValueError):
    """A Store object that is not what its key promises: a miss, counted and logged."""


@dataclass(frozen=True)
class Namespace:
    """The parts of a key before `@id:`; `kind` is `embedding` (vLLM's) or `encode-server` (native items)."""

    kind: str
    model: str
    revision: str
    encoder: str
    dtype: torch.dtype
    prefix: str = ""

    def __str__(self) -> str:
        head = f"{self.prefix}@" if self.prefix else ""
        return (f"{head}{self.kind}@model:{self.model}@revision:{self.revision or 'default'}"
                f"@encoder:{self.encoder}@dtype:{self.dtype}@protocol:{PROTOCOL}")

    def key(self, identifier: str) -> str:
        return f"{self}@id:{identifier}"

    def layout_key(self, identifier: str) -> str:
        return f"{self}@layout:{identifier}"


def value_size(shape: Sequence[int], dtype: torch.dtype) -> int:
    """The size of `encode_value`'s object for rows of `shape` and `dtype`, without copying anything; `ValueError`
    for rows the format cannot hold."""
    if len(shape) != 2:
        raise ValueError(f"an item's rows must be 2-D, got shape {tuple(shape)}")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"vLLM's Store format has no code for {dtype} (float32, float16, bfloat16 only)")
    return HEADER.size + shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size()


def encode_value(rows: torch.Tensor) -> bytes:
    """Header and rows of one item (`[rows, width]`, float32/float16/bfloat16) as one object."""
    value_size(rows.shape, rows.dtype)
    code = DTYPE_CODES[rows.dtype]
    data = rows.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return HEADER.pack(MAGIC, code, rows.shape[0], rows.shape[1]) + data


def decode_value(value: bytes | bytearray | memoryview, dtype: torch.dtype, width: int) -> torch.Tensor:
    """The rows of one object, checked against the dtype and width this reader expects."""
    if len(value) < HEADER.size:
        raise CorruptObject(f"{len(value)} bytes is shorter than the {HEADER.size}-byte header")
    magic, code, rows, stored_width = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise CorruptObject(f"magic {magic:#x} is not {MAGIC:#x}")
    stored_dtype = CODE_DTYPES.get(code)
    if stored_dtype != dtype:
        raise CorruptObject(f"dtype code {code} ({stored_dtype}) where {dtype} was expected")
    if stored_width != width:
        raise CorruptObject(f"rows of width {stored_width} where {width} was expected")
    if rows == 0:
        raise CorruptObject("an object of 0 rows")
    expected = HEADER.size + rows * width * dtype.itemsize
    if len(value) != expected:
        raise CorruptObject(f"{len(value)} bytes where the header promises {expected}")
    data = bytearray(memoryview(value)[HEADER.size:])
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(rows, width)


def encode_layout(layout: Any) -> bytes:
    """An `ItemLayout` as JSON (every field, tuples as lists)."""
    return json.dumps(dataclasses.asdict(layout), separators=(",", ":")).encode()


def decode_layout(value: bytes | bytearray | memoryview, layout_type: type) -> Any:
    """An `ItemLayout` back from `encode_layout`; `CorruptObject` if it is not one."""
    try:
        fields = json.loads(bytes(value))
        names = {field.name for field in dataclasses.fields(layout_type)}
        if not isinstance(fields, dict) or set(fields) != names:
            raise ValueError(f"fields {sorted(fields) if isinstance(fields, dict) else fields!r}")
        return layout_type(**{name: tuple(_tuples(v)) if isinstance(v, list) else v for name, v in fields.items()})
    except (ValueError, TypeError) as exc:
        raise CorruptObject(f"not an item layout: {exc}") from None


def _tuples(values: list) -> list:
    return [tuple(_tuples(v)) if isinstance(v, list) else v for v in values]


def marker_value(writer: str) -> bytes:
    return json.dumps({"protocol": PROTOCOL, "writer": writer}).encode()


def marker_protocol(value: bytes | bytearray | memoryview) -> str | None:
    """The protocol a marker names, or None when it cannot be read as a marker at all."""
    try:
        found = json.loads(bytes(value))
    except ValueError:
        return None
    protocol = found.get("protocol") if isinstance(found, dict) else None
    return protocol if isinstance(protocol, str) else None
