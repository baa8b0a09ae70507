"""Small inline images are read, hashed and decoded on the event loop; the others go to the decode pool."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from encode_server.media.decoding import MediaError, MediaLimits
from encode_server.media.loader import INLINE_DECODE_PIXELS, MediaLoader, parse_item
from encode_server.ops.settings import Settings
from tests.support.helpers import image_b64

pytestmark = pytest.mark.quick


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        return super().submit(*args, **kwargs)


def flat_png_b64(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def read(items: list[str], known=lambda key: False):
    pool = CountingPool()
    loader = MediaLoader(pool, MediaLimits.from_settings(Settings(), None))
    sources = [parse_item(item, index, "image") for index, item in enumerate(items)]

    async def run():
        return await loader.read("image", sources, lambda data: hashlib.blake2b(data).digest(),
                                 lambda modality, image: image.size, known)

    try:
        return asyncio.run(run()), pool.submitted
    finally:
        pool.shutdown()


def test_a_small_inline_image_is_read_decoded_and_hashed_without_the_pool():
    small = image_b64(56, 56, seed=3)
    (item,), submitted = read([small])
    assert submitted == 0
    assert item.digest == hashlib.blake2b(base64.b64decode(small)).digest()
    assert item.loaded is not None and item.loaded.layout == (56, 56) and item.loaded.decoded.size == (56, 56)
    (known,), submitted = read([small], known=lambda key: True)
    assert submitted == 0 and known.loaded is None  # the cache holds it: not decoded at all


def test_large_images_by_text_or_by_header_go_to_the_pool_with_the_same_result():
    side = int(INLINE_DECODE_PIXELS ** 0.5) + 1
    flat = flat_png_b64(side, side)  # a small file of more pixels than the loop decodes
    big = image_b64(120, 120, seed=4)  # beyond the inline text limit
    assert len(flat) < 4096 and len(big) > 32 * 1024
    items, submitted = read([flat, big])
    assert submitted == 2
    assert [item.loaded.layout for item in items] == [(side, side), (120, 120)]


def test_a_bad_inline_item_fails_with_its_location_on_the_loop():
    with pytest.raises(MediaError, match=r"mm_items\[1\].*not valid base64"):
        read([image_b64(56, 56), "AAAA*"])
    with pytest.raises(MediaError, match=r"mm_items\[0\]"):
        read([base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()])
