"""Base64 for media and embeddings: the same bytes as the standard library at every size, the same errors, and
the GIL kept for small inputs (decoded on the event loop, where handing the GIL away costs more than decoding)."""

from __future__ import annotations

import base64 as stdlib
import binascii
import os
import sys
import threading

import pytest

from encode_server.media import base64_codec

pytestmark = pytest.mark.quick

SIZES = [0, 1, 3, 1000, base64_codec.SMALL_CHARS * 3 // 4 - 1, base64_codec.SMALL_CHARS * 3 // 4 + 3, 200_000]


@pytest.mark.parametrize("size", SIZES)
def test_the_same_bytes_as_the_standard_library(size):
    data = os.urandom(size)
    text = stdlib.b64encode(data).decode()
    assert base64_codec.b64encode(data) == stdlib.b64encode(data)
    assert base64_codec.b64decode(text, validate=True) == data
    assert base64_codec.urlsafe_b64decode(stdlib.urlsafe_b64encode(data).decode()) == data


@pytest.mark.parametrize("size", [12, 200_000])
def test_invalid_input_raises_the_standard_error(size):
    text = stdlib.b64encode(os.urandom(size)).decode()
    with pytest.raises(binascii.Error):
        base64_codec.b64decode(text[:-5] + "!" + text[-4:], validate=True)


def test_small_inputs_keep_the_gil():
    text = stdlib.b64encode(os.urandom(12_000)).decode()
    ran, stop = [0], threading.Event()

    def other() -> None:
        while not stop.is_set():
            ran[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # the other thread gets the GIL only if a decode hands it over
    thread = threading.Thread(target=other)
    try:
        thread.start()
        while not ran[0]:
            pass
        before = ran[0]
        for _ in range(3):
            base64_codec.b64decode(text, validate=True)
        assert ran[0] == before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
