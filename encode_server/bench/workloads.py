"""What the load generators send: each request's list of media items, made before the clock starts.

- `single`: one item per request (the batching benchmark): 32 distinct images or clips, each request's
  copy made unique (below), so a server's embedding cache never answers it; with `repeat`, the 32
  items themselves again and again (what a cache would answer).
- `chat`: conversations of up to 4 turns; turn k sends the conversation's images 1..k (later turns
  re-send the earlier turns' images, as chat clients do), so a request carries 1 to 4 images. Each
  request picks a conversation with Zipf-like popularity (`p(rank) ~ 1 / rank^a`) and sends its next
  turn; a conversation past its last turn starts over with the same images (another user asking
  about the same pictures). Repeated media is the norm: this is where an embedding cache pays.
- `unique`: the same shape (1 to 4 images per request, 2.5 on average) but no image is ever sent
  twice: the worst case for a cache, which then only costs (hashing, copying rows, bookkeeping).

Distinct images are made cheaply: a small pool of random-pixel PNGs, each copy made unique by a
`tEXt` chunk holding a nonce (audio clips: a WAV `LIST/INFO` comment chunk). Decoders ignore the
chunk, so every copy costs the server exactly the same decode, preprocessing and forward, while its
bytes (and so its cache key) are its own. A `salt` goes into every nonce: two runs against the same
long-running server (`encode-bench --url`) then send different bytes too.
"""

from __future__ import annotations

import base64
import struct
import zlib
from itertools import count

import numpy as np

from encode_server.bench.load import make_payloads

#: Distinct pixel contents behind the nonce-tagged copies.
POOL_SIZE = 16


def png_with_nonce(png: bytes, nonce: str) -> bytes:
    """The same picture with a `tEXt` chunk holding `nonce` before `IEND`: different bytes, same pixels."""
    if png[-8:-4] != b"IEND":
        raise ValueError("not a PNG ending in IEND")
    data = b"nonce\x00" + nonce.encode()
    chunk = struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))
    return png[:-12] + chunk + png[-12:]


def wav_with_nonce(wav: bytes, nonce: str) -> bytes:
    """The same samples with a `LIST/INFO/ICMT` comment chunk holding `nonce` appended: different bytes."""
    if wav[:4] != b"RIFF" or wav[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    text = nonce.encode() + b"\x00"
    text += b"\x00" * (len(text) % 2)
    info = b"INFO" + b"ICMT" + struct.pack("<I", len(text)) + text
    body = wav[12:] + b"LIST" + struct.pack("<I", len(info)) + info
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body


def with_nonce(modality: str, item: bytes, nonce: str) -> bytes:
    """`item`'s file made unique by `nonce` without changing what it decodes to (PNG images, WAV clips)."""
    return wav_with_nonce(item, nonce) if modality == "audio" else png_with_nonce(item, nonce)


class _ImagePool:
    """Unique base64 PNGs on demand: pool image `n % POOL_SIZE` tagged with nonce `n`."""

    def __init__(self, image_size: int, tag: str) -> None:
        self.tag = tag
        self._bases = [base64.b64decode(p) for p in make_payloads("image", POOL_SIZE, image_size)]

    def image(self, number: int) -> str:
        png = png_with_nonce(self._bases[number % POOL_SIZE], f"{self.tag}-{number}")
        return base64.b64encode(png).decode()


class SingleWorkload:
    """One item per request: 32 distinct payloads, each request's copy unique (or, with `repeat`, the same 32
    payloads cycling)."""

    name = "single"

    def __init__(self, modality: str, image_size: int = 56, audio_seconds: float = 1.0, repeat: bool = False,
                 salt: str = "") -> None:
        self.modality, self.repeat, self.salt = modality, repeat, salt
        self.payloads = make_payloads(modality, 32, image_size, audio_seconds)
        self._raw = [base64.b64decode(payload) for payload in self.payloads]
        self._next = count()

    def item(self, number: int) -> str:
        if self.repeat:
            return self.payloads[number % len(self.payloads)]
        raw = with_nonce(self.modality, self._raw[number % len(self._raw)], f"single{self.salt}-{number}")
        return base64.b64encode(raw).decode()

    def requests(self, total: int) -> list[list[str]]:
        return [[self.item(next(self._next))] for _ in range(total)]


class ChatWorkload:
    """Zipf-popular conversations whose turns re-send the earlier turns' images."""

    name = "chat"

    def __init__(self, image_size: int = 56, conversations: int = 256, zipf_a: float = 1.1, max_turns: int = 4,
                 seed: int = 0, salt: str = "") -> None:
        self.max_turns = max_turns
        self._rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, conversations + 1) ** zipf_a
        self._popularity = weights / weights.sum()
        self._turn = np.zeros(conversations, dtype=np.int64)
        pool = _ImagePool(image_size, f"chat{salt}")
        self._images: dict[int, list[str]] = {}
        self._make = lambda conversation: [pool.image(conversation * max_turns + k) for k in range(max_turns)]

    def requests(self, total: int) -> list[list[str]]:
        picks = self._rng.choice(len(self._popularity), size=total, p=self._popularity)
        out = []
        for conversation in picks.tolist():
            turn = int(self._turn[conversation] % self.max_turns)
            self._turn[conversation] += 1
            if conversation not in self._images:
                self._images[conversation] = self._make(conversation)
            out.append(self._images[conversation][: turn + 1])
        return out


class UniqueWorkload:
    """1 to 4 images per request (the chat workload's shape), none of them ever sent twice."""

    name = "unique"

    def __init__(self, image_size: int = 56, max_turns: int = 4, seed: int = 0, salt: str = "") -> None:
        self.max_turns = max_turns
        self._pool = _ImagePool(image_size, f"unique{seed}{salt}")
        self._next_image = count()
        self._next_request = count()

    def requests(self, total: int) -> list[list[str]]:
        return [[self._pool.image(next(self._next_image)) for _ in range(next(self._next_request) % self.max_turns + 1)]
                for _ in range(total)]


WORKLOADS = ("single", "chat", "unique")


def make_workload(name: str, modality: str, image_size: int, audio_seconds: float, conversations: int = 256,
                  zipf_a: float = 1.1, repeat: bool = False, salt: str = ""):
    """A fresh workload (its state starts over, so every server configuration sees the same requests, up to
    `salt`); `repeat`: the single workload cycles through its 32 items instead of sending unique copies."""
    if name == "single":
        return SingleWorkload(modality, image_size, audio_seconds, repeat, salt)
    if modality != "image":
        raise ValueError(f"the {name} workload sends images only")
    if name == "chat":
        return ChatWorkload(image_size, conversations, zipf_a, salt=salt)
    if name == "unique":
        return UniqueWorkload(image_size, salt=salt)
    raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(WORKLOADS)}")
