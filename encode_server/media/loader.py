"""Fetch and decode one request's media items, each on its own, off the event loop.

Items arrive as URLs, `data:` URIs, bare base64, local paths (`file://` or an absolute path, only
inside `--allowed-local-media-dir`), `{"url"}`/`{"data"}` objects or, for video,
`{"frames": [...]}`. `parse_item` checks an item's shape without touching its bytes; `MediaLoader`
fetches URLs with aiohttp (through the URL guard) and decodes bytes in a thread pool. Every failure
is a `MediaError` naming the item, so a corrupt item fails only its own request (decode before you
fuse). The decoding itself (and `MediaLimits`, `MediaError`) lives in `media/decoding.py`.
"""

from __future__ import annotations

import asyncio
import binascii
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import numpy as np
from PIL import Image

from encode_server.media import base64_codec as base64
from encode_server.media.decoding import (
    MediaError,
    MediaLimits,
    decode_bytes,
    decode_frames,
    finish_image,
    open_image,
)
from encode_server.media.url_guard import (
    SEND_MEDIA_HOW,
    BlockedAddressError,
    GuardedConnector,
    content_type_refusal,
    resolve_local_path,
)

T = TypeVar("T")


@dataclass(frozen=True)
class MediaSource:
    """Where one item's bytes come from: `url`, `base64`, `data_uri`, `file`, `bytes` (already in memory) or
    `frames` (a list of sources)."""

    kind: str
    value: Any
    location: str


_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")
_FILE_EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,5}$")
#: `/etc/passwd`, `/data/images/cat`: an absolute path in base64's alphabet. Base64 media that starts with '/'
#: (a JPEG's "/9j/") is hundreds of characters at least, with '+' or '=' in it or runs between slashes far longer
#: than a folder's name; short text of path-like segments is taken for the path it looks like.
_ABSOLUTE_PATH = re.compile(r"(?:/[A-Za-z0-9_.\-]{1,48})+/?")


def _looks_like_path(text: str) -> bool:
    """`cat.jpg`, `./images/a.png`, `C:\\media\\clip.mp4`: short, no spaces, a '.' or '\\' (neither base64
    alphabet has them, so no base64 item is taken for a path) and an extension or a folder."""
    if len(text) > 1024 or ("." not in text and "\\" not in text) or any(char.isspace() for char in text):
        return False
    return bool(_FILE_EXTENSION.search(text)) or "/" in text or "\\" in text


def _parse_string(text: str, location: str) -> MediaSource:
    head = text[:16].lower()
    if head.startswith(("http://", "https://")):
        return MediaSource("url", text, location)
    if head.startswith("data:"):
        return MediaSource("data_uri", text, location)
    if head.startswith("file://"):
        return MediaSource("file", text, location)
    # "/9j/4AAQ..." is base64 (a JPEG); "/data/cat.jpg" is a path: only the latter is not base64.
    if text.startswith("/") and len(text) < 4096 and (
            not _BASE64.fullmatch(text)
            or (len(text) <= 256 and not text.startswith("/9j/") and _ABSOLUTE_PATH.fullmatch(text))):
        return MediaSource("file", text, location)
    if "://" in text[:32]:
        scheme = text.split("://", 1)[0]
        raise MediaError(location, f"unsupported URL scheme {scheme!r}: use http, https, data or file")
    if not text.strip():
        raise MediaError(location, "empty item")
    if _looks_like_path(text):
        how = (f"{SEND_MEDIA_HOW}; a local file needs an absolute path or file:// URL inside the server's "
               f"--allowed-local-media-dir")
        raise MediaError(location, f"{text[:200]!r} looks like a file path, not media: {how}")
    return MediaSource("base64", text, location)


def parse_item(raw: Any, index: int, modality: str) -> MediaSource:
    """Check one item's shape (no I/O, no decoding) and say where its bytes come from."""
    location = f"mm_items[{index}]"
    if isinstance(raw, bytes):  # from inside the server (the vLLM producer), never from a JSON body
        if not raw:
            raise MediaError(location, "empty item")
        return MediaSource("bytes", raw, location)
    if isinstance(raw, str):
        return _parse_string(raw, location)
    if not isinstance(raw, dict):
        raise MediaError(location, f"expected a string or an object, got {type(raw).__name__}")
    keys = set(raw) & {"url", "data", "frames"}
    if len(keys) != 1:
        raise MediaError(location, "an item object needs exactly one of 'url', 'data' or 'frames'")
    (key,) = keys
    value = raw[key]
    if key == "frames":
        if modality != "video":
            raise MediaError(location, "'frames' is only for video items")
        if not isinstance(value, list) or not value:
            raise MediaError(location, "'frames' must be a non-empty list of image items")
        frames = []
        for frame_index, frame in enumerate(value):
            frame_location = f"{location}.frames[{frame_index}]"
            if isinstance(frame, dict) and "frames" in frame:
                raise MediaError(frame_location, "frames cannot nest")
            source = parse_item(frame, frame_index, "image")
            frames.append(MediaSource(source.kind, source.value, frame_location))
        return MediaSource("frames", frames, location)
    if not isinstance(value, str):
        raise MediaError(location, f"'{key}' must be a string, got {type(value).__name__}")
    if key == "url":
        source = _parse_string(value, location)
        if source.kind == "base64":
            raise MediaError(location, "'url' must be an http(s)://, data: or file:// URL")
        return source
    if not value.strip():
        raise MediaError(location, "'data' is empty")
    return MediaSource("base64", value, location)


def decode_base64(text: str, location: str) -> bytes:
    """Standard or URL-safe base64, whitespace allowed; a clear error otherwise."""
    compact = "".join(text.split()) if any(ws in text for ws in " \n\r\t") else text
    try:
        if "-" in compact or "_" in compact:
            return base64.urlsafe_b64decode(compact + "=" * (-len(compact) % 4))
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(location, f"not valid base64 ({exc})") from None


def decode_data_uri(uri: str, location: str) -> bytes:
    """The payload of a `data:[<type>][;base64],<data>` URI."""
    header, sep, payload = uri.partition(",")
    if not sep:
        raise MediaError(location, "malformed data URI: no ',' before the payload")
    if header.lower().endswith(";base64"):
        return decode_base64(payload, location)
    return urllib.parse.unquote_to_bytes(payload)


async def each_in_order(steps: list[Awaitable[T]]) -> list[T]:
    """Run one step per item concurrently (a lone one without a task); the results in item order, or the
    first item's error in item order, after every step has ended."""
    if len(steps) == 1:  # most requests: no task per item
        return [await steps[0]]
    results = await asyncio.gather(*steps, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)


@dataclass(frozen=True)
class LoadedItem:
    """One decoded item, what the model will make of it (its `ItemLayout`), and its raw bytes
    (what tensor-parallel ranks and replicas are sent to decode for themselves)."""

    decoded: Any
    layout: Any
    raw: bytes | list[bytes] = b""


#: Inline images (base64 or data URIs) up to this many characters are decoded on the event loop: for a
#: small image the hop to a decode thread and back costs about as much as decoding it, and at high
#: concurrency the hops contend for the GIL with the loop. Up to 32 KiB of base64 is at most ~24 KiB of
#: file, and only images of at most INLINE_DECODE_PIXELS (by their header) are decoded there: a small
#: file of a large flat image still goes to a thread.
INLINE_DECODE_CHARS = 32 * 1024
INLINE_DECODE_PIXELS = 256 * 256


@dataclass(frozen=True)
class RawItem:
    """One item's bytes as received or fetched (a video's frames: a list) and their digest; `loaded` is the
    item decoded when `MediaLoader.read` expected the cache to miss it, else None."""

    source: MediaSource
    data: bytes | list[bytes]
    digest: Any
    loaded: LoadedItem | None = None


class MediaLoader:
    """Fetches and decodes items; decoding runs in `pool`, fetching on one shared aiohttp session."""

    def __init__(self, pool: Executor, limits: MediaLimits, fetch_timeout_s: float = 30.0,
                 header_only_images: bool = False) -> None:
        self._pool = pool
        self.header_only_images = header_only_images  # images opened, not decoded: a preprocessing pool decodes
        self.limits = limits
        self._max_fetch_bytes = limits.max_fetch_bytes
        self._timeout = aiohttp.ClientTimeout(total=fetch_timeout_s, sock_connect=10.0)
        self._session: aiohttp.ClientSession | None = None

    def warmup(self, modalities: Sequence[str]) -> None:
        """Import and exercise the decoders once, so the first request does not pay for it."""
        if "audio" in modalities:
            import librosa

            librosa.resample(np.zeros(1600, dtype=np.float32), orig_sr=16000, target_sr=8000)
        if "video" in modalities:
            try:
                import av  # noqa: F401
            except ImportError:
                pass

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def load(self, modality: str, sources: Sequence[MediaSource],
                   describe: Callable[[str, Any], Any]) -> list[LoadedItem]:
        """Decode every item concurrently; raise the first item's error in item order."""
        return await each_in_order([self._load_one(modality, source, describe) for source in sources])

    async def read(self, modality: str, sources: Sequence[MediaSource], digest: Callable[[bytes | list[bytes]], Any],
                   describe: Callable[[str, Any], Any], known: Callable[[Any], bool]) -> list[RawItem]:
        """Every item's bytes (URLs fetched, inline items un-base64'd, files read, a video's frame files one
        by one) and `digest` of them; the first item's error in item order. This is where the embedding
        cache looks items up: raw bytes known, not yet decoded.

        Small inline images are read, hashed and decoded right here, on the event loop (as `load` decodes
        them, see INLINE_DECODE_CHARS); the others in one trip to the pool. Either way, an item whose digest
        is not `known` (a thread-safe hint: the cache holds it or is computing it) is decoded at once, so a
        miss costs no second trip; a known one is left undecoded (`loaded` None): a hit skips decoding.
        """
        return await each_in_order([self._read_one(modality, source, digest, describe, known) for source in sources])

    async def _read_one(self, modality: str, source: MediaSource, digest: Callable[[bytes | list[bytes]], Any],
                        describe: Callable[[str, Any], Any], known: Callable[[Any], bool]) -> RawItem:
        if source.kind == "frames":
            if len(source.value) > self.limits.max_video_frames:
                raise MediaError(source.location, f"{len(source.value)} frames is above the limit of "
                                                  f"{self.limits.max_video_frames} (--max-video-frames)")
            parts: bytes | MediaSource | list[bytes | MediaSource] = [
                await self._raw_bytes(frame, "image") for frame in source.value]
        else:
            parts = await self._raw_bytes(source, modality)
            small = self._small_inline_image(modality, source)
            if small is not None:  # cheaper here than a hop to a thread and back (see INLINE_DECODE_CHARS)
                data, image = small
                key = digest(data)
                return RawItem(source, data, key) if known(key) else RawItem(
                    source, data, key, self._finish(data, image, source, modality, describe))
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._read_in_pool, modality, source, parts, digest, describe, known)

    def _read_in_pool(self, modality: str, source: MediaSource, parts: Any, digest: Callable[[Any], Any],
                      describe: Callable[[str, Any], Any], known: Callable[[Any], bool]) -> RawItem:
        data = [self._bytes_of(part) for part in parts] if isinstance(parts, list) else self._bytes_of(parts)
        key = digest(data)
        if known(key):
            return RawItem(source, data, key)
        if isinstance(data, list):
            return RawItem(source, data, key, self._decode_frames(data, source, modality, describe))
        return RawItem(source, data, key, self._decode(data, source, modality, describe))

    async def decode_read(self, modality: str, item: RawItem, describe: Callable[[str, Any], Any]) -> LoadedItem:
        """An item `read` returned, decoded (at once when `read` already did it, else in the pool)."""
        if item.loaded is not None:
            return item.loaded
        loop = asyncio.get_running_loop()
        if isinstance(item.data, list):
            return await loop.run_in_executor(self._pool, self._decode_frames, item.data, item.source, modality,
                                              describe)
        return await loop.run_in_executor(self._pool, self._decode, item.data, item.source, modality, describe)

    async def _load_one(self, modality: str, source: MediaSource,
                        describe: Callable[[str, Any], Any]) -> LoadedItem:
        loop = asyncio.get_running_loop()
        if source.kind == "frames":
            if len(source.value) > self.limits.max_video_frames:
                raise MediaError(source.location, f"{len(source.value)} frames is above the limit of "
                                                  f"{self.limits.max_video_frames} (--max-video-frames)")
            frame_bytes = [await self._raw_bytes(frame, "image") for frame in source.value]
            return await loop.run_in_executor(
                self._pool, self._decode_frames, frame_bytes, source, modality, describe
            )
        raw = await self._raw_bytes(source, modality)
        small = self._small_inline_image(modality, source)
        if small is not None:  # small: cheaper here than a hop to a thread
            return self._finish(*small, source, modality, describe)
        return await loop.run_in_executor(self._pool, self._decode, raw, source, modality, describe)

    def _small_inline_image(self, modality: str, source: MediaSource) -> tuple[bytes, Image.Image] | None:
        """An inline image's bytes and the image opened from its header, when it is small enough to decode on
        the event loop (its text and its pixels), else None. An error in its base64 or header is raised here,
        as the pool would raise it."""
        if modality != "image" or source.kind not in ("base64", "data_uri") or len(source.value) > INLINE_DECODE_CHARS:
            return None
        data = self._bytes_of(source)
        image = open_image(data, self.limits.max_image_pixels, source.location)
        width, height = image.size
        return (data, image) if width * height <= INLINE_DECODE_PIXELS else None

    def _finish(self, data: bytes, image: Image.Image, source: MediaSource, modality: str,
                describe: Callable[[str, Any], Any]) -> LoadedItem:
        """An image `_small_inline_image` opened, decoded as `_decode` would."""
        decoded = finish_image(image, source.location, self.header_only_images)
        return LoadedItem(decoded, _describe(describe, modality, decoded, source.location), data)

    async def _raw_bytes(self, source: MediaSource, modality: str) -> bytes | MediaSource:
        """URL bytes are fetched here; inline sources and files are read later, in the pool."""
        if source.kind != "url":
            return source
        return await self._fetch(source.value, source.location, modality)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = GuardedConnector(allow_private=self.limits.allow_private_urls,
                                         extra_allowed=self.limits.extra_allowed_networks, limit=64)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector,
                                                  auto_decompress=False)
        return self._session

    async def fetch(self, url: str, location: str, modality: str) -> bytes:
        """The body of an http(s) URL, through the URL guard and within the fetch limits."""
        return await self._fetch(url, location, modality)

    async def _fetch(self, url: str, location: str, modality: str) -> bytes:
        try:
            async with self._client().get(url, max_redirects=5) as response:
                if response.status != 200:
                    raise MediaError(location, f"fetching {url} gave HTTP {response.status}")
                refusal = content_type_refusal(response.headers.get("Content-Type"), modality)
                if refusal:
                    raise MediaError(location, f"{url}: {refusal}")
                if response.content_length is not None and response.content_length > self._max_fetch_bytes:
                    raise MediaError(location, f"{url} is {response.content_length} bytes, above the limit "
                                               f"of {self._max_fetch_bytes} (--max-request-bytes)")
                chunks, size = [], 0
                async for chunk in response.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > self._max_fetch_bytes:
                        raise MediaError(location, f"{url} is larger than {self._max_fetch_bytes} bytes "
                                                   f"(--max-request-bytes)")
                    chunks.append(chunk)
                return b"".join(chunks)
        except MediaError:
            raise
        except BlockedAddressError as exc:
            raise MediaError(location, str(exc)) from None
        except aiohttp.TooManyRedirects:
            raise MediaError(location, f"fetching {url}: too many redirects") from None
        except asyncio.TimeoutError:
            raise MediaError(location, f"fetching {url} timed out") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise MediaError(location, f"could not fetch {url}: {exc}") from None

    def _bytes_of(self, raw: bytes | MediaSource) -> bytes:
        if isinstance(raw, bytes):
            return raw
        if raw.kind == "bytes":
            return raw.value
        if raw.kind == "file":
            return self._read_local(raw)
        if raw.kind == "data_uri":
            return decode_data_uri(raw.value, raw.location)
        return decode_base64(raw.value, raw.location)

    def _read_local(self, source: MediaSource) -> bytes:
        try:
            path = resolve_local_path(source.value, self.limits.allowed_local_media_dir)
        except PermissionError as exc:
            raise MediaError(source.location, str(exc)) from None
        size = path.stat().st_size
        if size > self._max_fetch_bytes:
            raise MediaError(source.location, f"the file is {size} bytes, above the limit of {self._max_fetch_bytes} "
                                              f"(--max-request-bytes)")
        return path.read_bytes()

    def _decode(self, raw: bytes | MediaSource, source: MediaSource, modality: str,
                describe: Callable[[str, Any], Any]) -> LoadedItem:
        data = self._bytes_of(raw)
        decoded = decode_bytes(modality, data, self.limits, source.location, self.header_only_images)
        return LoadedItem(decoded, _describe(describe, modality, decoded, source.location), data)

    def _decode_frames(self, frame_bytes: list[bytes | MediaSource], source: MediaSource, modality: str,
                       describe: Callable[[str, Any], Any]) -> LoadedItem:
        datas = [self._bytes_of(raw) for raw in frame_bytes]
        frames = decode_frames(datas, self.limits, source.location, self.header_only_images)
        return LoadedItem(frames, _describe(describe, modality, frames, source.location), datas)


def _describe(describe: Callable[[str, Any], Any], modality: str, decoded: Any, location: str) -> Any:
    try:
        return describe(modality, decoded)
    except ValueError as exc:  # encode_server.models.ItemError is a ValueError
        raise MediaError(location, str(exc)) from None
