"""Images (and video frames given as images) decode as `transformers.image_utils.load_image` decodes them:
upright by their EXIF orientation, then RGB."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
from PIL import Image
from transformers.image_utils import load_image

from encode_server.media.decoding import MediaLimits, decode_frames, decode_image
from encode_server.models import load_adapter
from encode_server.ops.settings import Settings
from tests.support.helpers import InProcessServer

ORIENTATION = 0x0112


def phone_jpeg(width: int = 168, height: int = 84, orientation: int = 6) -> bytes:
    """A JPEG stored `width x height` whose EXIF says to rotate it (6: 90 degrees clockwise)."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2] = (255, 0, 0)  # left half red, right half blue: the rotation is visible
    pixels[:, width // 2:] = (0, 0, 255)
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", exif=exif, quality=95)
    return buffer.getvalue()


def test_decode_image_applies_the_exif_orientation_as_transformers_does():
    data = phone_jpeg()
    assert Image.open(io.BytesIO(data)).size == (168, 84)
    reference = load_image(Image.open(io.BytesIO(data)))
    decoded = decode_image(data, 50_000_000, "mm_items[0]")
    assert decoded.size == reference.size == (84, 168)
    assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), np.asarray(reference))
    frames = decode_frames([data, data], MediaLimits.from_settings(Settings(), adapter=None), "mm_items[0]")
    assert all(np.array_equal(np.asarray(frame), np.asarray(reference)) for frame in frames)


def test_an_image_without_exif_is_unchanged():
    pixels = np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    assert np.array_equal(np.asarray(decode_image(buffer.getvalue(), 10_000, "x")), pixels)


def test_the_grid_is_the_one_transformers_sees():
    data = phone_jpeg()
    adapter = load_adapter("tiny-qwen2.5-vl", "cpu", "float32")
    want = adapter.processor.image_processor(images=[load_image(Image.open(io.BytesIO(data)))], return_tensors="pt")
    assert want["image_grid_thw"].tolist() == [[1, 12, 6]]
    assert adapter.processor.item_layout("image", decode_image(data, 50_000_000, "x")).grid_thw == (1, 12, 6)
    with InProcessServer() as server:
        encoded = base64.b64encode(data).decode()
        image = httpx.post(server.url + "/encode", timeout=60, json={
            "req_id": "exif", "modality": "image", "mm_items": [encoded]})
        assert image.status_code == 200, image.text
        assert image.json()["items"][0]["grid_thw"] == [1, 12, 6]
        video = httpx.post(server.url + "/encode", timeout=60, json={
            "req_id": "exif-video", "modality": "video", "mm_items": [{"frames": [encoded, encoded]}]})
        assert video.status_code == 200, video.text
        assert video.json()["items"][0]["grid_thw"] == [1, 12, 6]
