"""What the load generators send: each request's list of media items, made before the clock starts.

- `single`: one item per request, cycling through 32 distinct images or clips (the batching benchmark).
- `chat`: conversations of up to 4 turns; turn k sends the conversation's images 1..k (later turns
  re-send the earlier turns' images, as chat clients do), so a request carries 1 to 4 images. Each
  request picks a conversation with Zipf-like popularity (`p(rank) ~ 1 / rank^a`) and sends its next
  turn; a conversation past its last turn starts over with the same images (another user asking
  about the same pictures). Repeated media is the norm: this is where an embedding cache pays.
- `unique`: the same shape (1 to 4 images per request, 2.5 on average) but no image is ever sent
  twice: the worst case for a cache, which then only costs (hashing, copying rows, bookkeeping).

Distinct images are made cheaply: a small pool of random-pixel PNGs, each copy made unique by a
`tEXt` chunk holding a nonce. Decoders ignore the chunk, so every copy costs the server exactly the
same decode, preprocessing and forward, while its bytes (and so its cache key) are its own.
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


class _ImagePool:
    """Unique base64 PNGs on demand: pool image `n % POOL_SIZE` tagged with nonce `n`."""

    def __init__(self, image_size: int, tag: str) -> None:
        self.tag = tag
        self._bases = [base64.b64decode(p) for p in make_payloads("image", POOL_SIZE, image_size)]

    def image(self, number: int) -> str:
        png = png_with_nonce(self._bases[number % POOL_SIZE], f"{self.tag}-{number}")
        return base64.b64encode(png).decode()


class SingleWorkload:
    """One item per request, cycling through 32 distinct payloads."""

    name = "single"

    def __init__(self, modality: str, image_size: int = 56, audio_seconds: float = 1.0) -> None:
        self.payloads = make_payloads(modality, 32, image_size, audio_seconds)
        self._next = count()

    def requests(self, total: int) -> list[list[str]]:
        return [[self.payloads[next(self._next) % len(self.payloads)]] for _ in range(total)]


class ChatWorkload:
    """Zipf-popular conversations whose turns re-send the earlier turns' images."""

    name = "chat"

    def __init__(self, image_size: int = 56, conversations: int = 256, zipf_a: float = 1.1, max_turns: int = 4,
                 seed: int = 0) -> None:
        self.max_turns = max_turns
        self._rng = np.random.default_rng(seed)
        weights = 1.0 / np.arange(1, conversations + 1) ** zipf_a
        self._popularity = weights / weights.sum()
        self._turn = np.zeros(conversations, dtype=np.int64)
        pool = _ImagePool(image_size, "chat")
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

    def __init__(self, image_size: int = 56, max_turns: int = 4, seed: int = 0) -> None:
        self.max_turns = max_turns
        self._pool = _ImagePool(image_size, f"unique{seed}")
        self._next_image = count()
        self._next_request = count()

    def requests(self, total: int) -> list[list[str]]:
        return [[self._pool.image(next(self._next_image)) for _ in range(next(self._next_request) % self.max_turns + 1)]
                for _ in range(total)]


WORKLOADS = ("single", "chat", "unique")


def make_workload(name: str, modality: str, image_size: int, audio_seconds: float, conversations: int = 256,
                  zipf_a: float = 1.1):
    """A fresh workload (its state starts over, so every server configuration sees the same requests)."""
    if name == "single":
        return SingleWorkload(modality, image_size, audio_seconds)
    if modality != "image":
        raise ValueError(f"the {name} workload sends images only")
    if name == "chat":
        return ChatWorkload(image_size, conversations, zipf_a)
    if name == "unique":
        return UniqueWorkload(image_size)
    raise ValueError(f"unknown workload {name!r}: expected one of {', '.join(WORKLOADS)}")
