"""Some tensors of safetensors files, read by byte range from any seekable file, written as one new file.

The format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length
`N`, `N` bytes of JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
offsets relative to the data that starts at `8 + N`), then the data. `read_header` reads the first
two parts (two reads); `copy_tensors` reads each chosen tensor's bytes and nothing else (tensors
that lie back to back in a file are read as one range) and writes them, unchanged, into a new file
whose header lists just them. The files are opened by the caller's `open_file`, so the same code
reads a remote file (`huggingface_hub.HfFileSystem`, one HTTP Range request per read) or a local one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

#: Bytes per element of each safetensors dtype; tensors are written widest first, as safetensors does,
#: so that every tensor starts at a multiple of its element size.
ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
              "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
#: A header longer than this is refused (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: The largest single read while copying tensors.
CHUNK_BYTES = 64 << 20


class SafetensorsFormatError(ValueError):
    """A file that is not a valid safetensors file; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset of its first byte, from the start of the data
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """One safetensors file's header."""

    data_start: int  # 8 + the JSON's length: where the data begins in the file
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


class Progress(Protocol):
    def update(self, n: int) -> object: ...


OpenFile = Callable[[str], AbstractContextManager[BinaryIO]]


def read_header(handle: BinaryIO, name: str) -> Header:
    """The header of the safetensors file open as `handle` (read: 8 bytes, then the JSON)."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise SafetensorsFormatError(f"{name}: shorter than the 8 bytes of a safetensors header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(f"{name}: header length {length} is not plausible; not a safetensors file")
    raw = handle.read(length)
    if len(raw) != length:
        raise SafetensorsFormatError(f"{name}: the header is cut short ({len(raw)} of {length} bytes)")
    try:
        parsed = json.loads(raw)
        metadata = {str(k): str(v) for k, v in (parsed.pop("__metadata__", None) or {}).items()}
        tensors = {key: TensorEntry(str(value["dtype"]), tuple(int(d) for d in value["shape"]),
                                    int(value["data_offsets"][0]), int(value["data_offsets"][1]))
                   for key, value in parsed.items()}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise SafetensorsFormatError(f"{name}: the header is not valid safetensors JSON ({exc})") from None
    return Header(data_start=8 + length, tensors=tensors, metadata=metadata)


def _runs(entries: list[tuple[str, TensorEntry]]) -> Iterator[list[tuple[str, TensorEntry]]]:
    """The entries (sorted by offset) grouped into runs that lie back to back in the file."""
    run: list[tuple[str, TensorEntry]] = []
    for key, entry in entries:
        if run and run[-1][1].end != entry.begin:
            yield run
            run = []
        run.append((key, entry))
    if run:
        yield run


def _layout(chosen: dict[str, tuple[str, TensorEntry]], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The new file's header (padded to 8 bytes) and where each tensor's data goes in the new file."""
    order = sorted(chosen, key=lambda key: (-ITEM_BYTES.get(chosen[key][1].dtype, 1), key))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offsets: dict[str, int] = {}
    position = 0
    for key in order:
        entry = chosen[key][1]
        header[key] = {"dtype": entry.dtype, "shape": list(entry.shape),
                       "data_offsets": [position, position + entry.nbytes]}
        offsets[key] = position
        position += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def copy_tensors(open_file: OpenFile, headers: dict[str, Header], chosen: dict[str, str], out: Path,
                 progress: Callable[[str, int], AbstractContextManager[Progress]]) -> int:
    """Write `out`, a safetensors file holding exactly the `chosen` tensors (key -> the file that holds
    it, whose header is in `headers`), their bytes copied unchanged; returns the tensor bytes read.

    Each file's tensors are read in offset order, back-to-back ones as one range, in reads of at most
    `CHUNK_BYTES`; `progress(file name, bytes to read)` is entered around each file's reads and told
    of every chunk. The new header keeps the first file's `__metadata__` (e.g. `{"format": "pt"}`)."""
    entries: dict[str, tuple[str, TensorEntry]] = {}
    for key, name in chosen.items():
        entry = headers[name].tensors.get(key)
        if entry is None:
            raise SafetensorsFormatError(f"{name}: has no tensor {key}, although the index says it holds it")
        entries[key] = (name, entry)
    first = min(chosen.values(), default=None)
    prefix, offsets = _layout(entries, headers[first].metadata if first is not None else {})
    total = 0
    with open(out, "wb") as sink:
        sink.write(prefix)
        sink.truncate(len(prefix) + sum(entry.nbytes for _, entry in entries.values()))
        for name in sorted(set(chosen.values())):
            mine = sorted(((key, entry) for key, (owner, entry) in entries.items() if owner == name),
                          key=lambda item: item[1].begin)
            size = sum(entry.nbytes for _, entry in mine)
            with open_file(name) as source, progress(name, size) as bar:
                for run in _runs(mine):
                    _copy_run(source, name, headers[name].data_start, run, sink, len(prefix), offsets, bar)
            total += size
    return total


def _copy_run(source: BinaryIO, name: str, data_start: int, run: list[tuple[str, TensorEntry]], sink: BinaryIO,
              out_data_start: int, offsets: dict[str, int], bar: Progress) -> None:
    """Read one run of back-to-back tensors from `source` and write each where `offsets` puts it."""
    start, end = run[0][1].begin, run[-1][1].end
    source.seek(data_start + start)
    position = start  # of the next byte to read, relative to the data start
    index = 0  # the tensor holding `position`
    while position < end:
        wanted = min(CHUNK_BYTES, end - position)
        data = source.read(wanted)
        if len(data) > wanted:
            raise SafetensorsFormatError(f"{name}: asked for {wanted} bytes, got {len(data)} (the server ignored the "
                                         "byte range)")
        if not data:
            raise SafetensorsFormatError(f"{name}: the file ends at byte {data_start + position}, inside a tensor")
        view = memoryview(data)
        while view:
            key, entry = run[index]
            take = min(len(view), entry.end - position)
            sink.seek(out_data_start + offsets[key] + position - entry.begin)
            sink.write(view[:take])
            view, position = view[take:], position + take
            if position == entry.end:
                index += 1
        bar.update(len(data))
