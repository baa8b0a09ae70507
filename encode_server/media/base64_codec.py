"""Base64 at the speed each caller needs: SIMD (pybase64) for large inputs, the standard library's for small ones.

pybase64 decodes a 200 KB image 40 times faster than the standard library, but lets go of the GIL on every call,
however small. On the event loop that hand-off costs more than a small input's decoding: another thread (the
forward's) takes the GIL, and the loop waits for it back, up to the interpreter's switch interval. The standard
library keeps the GIL and decodes about 500 MB/s, so below `SMALL_CHARS` (a 64 KiB text: 0.1 ms) it decodes.
Both raise `binascii.Error` on invalid input.
"""

from __future__ import annotations

import base64
import binascii

import pybase64

#: Up to this many characters (or bytes, to encode) the standard library does it, keeping the GIL.
SMALL_CHARS = 64 * 1024

Error = binascii.Error


def b64decode(text: str | bytes, validate: bool = False) -> bytes:
    if len(text) <= SMALL_CHARS:
        return base64.b64decode(text, validate=validate)
    return pybase64.b64decode(text, validate=validate)


def urlsafe_b64decode(text: str | bytes) -> bytes:
    if len(text) <= SMALL_CHARS:
        return base64.urlsafe_b64decode(text)
    return pybase64.urlsafe_b64decode(text)


def b64encode(data: bytes | bytearray | memoryview) -> bytes:
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size <= SMALL_CHARS * 3 // 4:
        return base64.b64encode(data)
    return pybase64.b64encode(data)
