"""The modality of an item that comes without one: SGLang's gRPC `EncodeRequest` names none.

SGLang's own gRPC encoder treats every item as an image. This server also takes audio and video there, and
tells them apart per item, without I/O and without decoding: the type of a `data:` URL (`data:audio/wav;...`),
else the file extension of an `http(s)://` or `file://` URL or path, else the first bytes of base64 media (the
containers' magic numbers: RIFF/WAVE, FLAC, Ogg, MP3, ISO BMFF, Matroska/WebM, AVI). What none of these names is
an image, as in SGLang. A caller may also name the modality itself (`modality` gRPC metadata), which wins.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
from collections.abc import Sequence
from urllib.parse import urlsplit

#: Extensions `mimetypes` may not know on a minimal system.
_EXTENSIONS = {".wav": "audio", ".flac": "audio", ".mp3": "audio", ".ogg": "audio", ".oga": "audio", ".m4a": "audio",
               ".opus": "audio", ".mp4": "video", ".m4v": "video", ".webm": "video", ".mkv": "video",
               ".mov": "video", ".avi": "video"}


def sniff(head: bytes) -> str:
    """The modality of media whose file starts with `head` (image when nothing else matches)."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE" or head[:4] in (b"fLaC", b"OggS") or head[:3] == b"ID3" \
            or head[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "audio"
    if head[4:8] == b"ftyp":
        return "audio" if head[8:11] == b"M4A" else "video"
    if head[:4] == b"\x1a\x45\xdf\xa3" or head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video"
    return "image"


def _by_name(path: str) -> str | None:
    suffix = path[path.rfind("."):].lower() if "." in path.rsplit("/", 1)[-1] else ""
    if suffix in _EXTENSIONS:
        return _EXTENSIONS[suffix]
    kind = (mimetypes.guess_type("x" + suffix)[0] or "").partition("/")[0] if suffix else ""
    return kind if kind in ("image", "audio", "video") else None


def item_modality(item: str) -> str:
    """One item's modality, as the module docstring says."""
    head = item[:256]
    lowered = head.lower()
    if lowered.startswith("data:"):
        kind = lowered[5:].partition("/")[0]
        if kind in ("image", "audio", "video"):
            return kind
        payload = item.partition(",")[2]
    elif lowered.startswith(("http://", "https://", "file://")):
        return _by_name(urlsplit(item).path) or "image"
    elif head.startswith("/") and len(item) < 4096 and "." in item.rsplit("/", 1)[-1]:
        return _by_name(item) or "image"  # a path (base64 has no '.')
    else:
        payload = item
    try:
        return sniff(base64.b64decode(payload[:64].strip() + "=" * (-len(payload[:64].strip()) % 4)))
    except (binascii.Error, ValueError):
        return "image"


def part_modality(items: Sequence[str], named: str | None = None) -> str:
    """The one modality of a part's items: `named` when given, else each item's (ValueError when they differ)."""
    if named:
        return named.lower()
    found = [item_modality(item) for item in items]
    if len(set(found)) > 1:
        described = ", ".join(f"mm_items[{index}] {kind}" for index, kind in enumerate(found))
        raise ValueError(f"the items of one part must share a modality, got {described}: send each modality as "
                         f"its own part (or name it in the 'modality' gRPC metadata)")
    return found[0] if found else "image"
