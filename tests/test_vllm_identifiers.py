"""vLLM's item identifiers and decoded pixels, against what vLLM 0.33.0 itself computed.

`tests/golden/vllm-0.33.0-identifiers.json` was written by `scripts/vllm_golden.py generate` (vLLM's
`ImageMediaIO.load_bytes` and `ProcessorInputs.get_mm_hashes`) for the tiny images in
`tests/golden/vllm-images/`: one per decode path (RGB, transparent RGBA, palette with tRNS, grayscale,
EXIF-rotated JPEG, CMYK JPEG).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from encode_server.delivery.vllm_hash import EncodedImage, hash_kwargs, image_identifier
from encode_server.media.decoding import MediaError, decode_image
from encode_server.media.vllm_images import data_url_payload, decode_vllm_image

pytestmark = pytest.mark.quick

GOLDEN = Path(__file__).parent / "golden"
REFERENCE = json.loads((GOLDEN / "vllm-0.33.0-identifiers.json").read_text())
NAMES = sorted(REFERENCE["images"])


def image_bytes(name: str) -> bytes:
    return (GOLDEN / "vllm-images" / name).read_bytes()


def test_the_golden_set_covers_every_decode_path():
    assert set(NAMES) == {"rgb.png", "rgba.png", "palette_trns.png", "gray.png", "exif6.jpg", "cmyk.jpg"}
    assert sum(len(image_bytes(name)) for name in NAMES) < 8 * 1024


@pytest.mark.parametrize("name", NAMES)
def test_pixels_and_io_config_are_vllms(name):
    expected = REFERENCE["images"][name]
    decoded = decode_vllm_image(image_bytes(name), 10**8, "item")
    assert list(decoded.image.size) == expected["size"] and decoded.image.mode == "RGB"
    pixels = np.ascontiguousarray(np.asarray(decoded.image))
    assert hashlib.sha256(pixels.tobytes()).hexdigest() == expected["pixels_sha256"]
    io_config = decoded.io_config and {key: list(value) if isinstance(value, tuple) else value
                                       for key, value in decoded.io_config.items()}
    assert io_config == expected["io_config"]
    # Where the native decode is said to agree, it gives these very pixels; the PNG always does.
    if decoded.native_equivalent:
        assert np.array_equal(np.asarray(decode_image(image_bytes(name), 10**8, "item")), pixels)
    assert np.array_equal(np.asarray(decode_image(decoded.png(), 10**8, "item")), pixels)


def test_transparency_is_composited_on_white_not_dropped():
    decoded = decode_vllm_image(image_bytes("rgba.png"), 10**8, "item")
    native = np.asarray(decode_image(image_bytes("rgba.png"), 10**8, "item"))
    assert not decoded.native_equivalent
    assert not np.array_equal(np.asarray(decoded.image), native)
    source = np.asarray(Image.open(io.BytesIO(image_bytes("rgba.png"))).convert("RGBA"))
    assert (np.asarray(decoded.image)[source[..., 3] == 0] == 255).all()  # fully transparent: white


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "sha512"])
def test_identifiers_are_vllms(name, algorithm):
    expected = REFERENCE["images"][name]
    data = image_bytes(name)
    io_config = decode_vllm_image(data, 10**8, "item").io_config
    for model_id, identifier in expected["identifiers"][algorithm].items():
        assert image_identifier(algorithm, model_id, EncodedImage(data, io_config)) == identifier


@pytest.mark.parametrize("name", NAMES)
def test_a_uuid_is_the_identifier_verbatim(name):
    data = image_bytes(name)
    uuid = REFERENCE["uuid"]
    assert image_identifier("blake3", "any", EncodedImage(data), uuid) == REFERENCE["images"][name]["with_uuid"] == uuid


def test_the_framing_tells_apart_what_plain_concatenation_would_not():
    assert hash_kwargs("sha256", model_id="ab", image=EncodedImage(b"c")) != \
        hash_kwargs("sha256", model_id="a", image=EncodedImage(b"bc"))
    assert hash_kwargs("sha256", a=[1, 2]) != hash_kwargs("sha256", a={"0": 1, "1": 2})
    with pytest.raises(ValueError, match="unsupported hash algorithm"):
        hash_kwargs("md5", a=1)


def test_data_urls_are_read_as_vllm_reads_them():
    payload = image_bytes("rgb.png")
    import base64

    encoded = base64.b64encode(payload).decode()
    assert data_url_payload(f"data:image/png;base64,{encoded}", "item") == payload
    assert data_url_payload(f"data:;base64,{encoded}", "item") == payload
    with pytest.raises(MediaError, match="only base64"):
        data_url_payload("data:image/png,%89PNG", "item")
    with pytest.raises(MediaError, match="not valid base64"):
        data_url_payload(f"data:image/png;base64,{encoded[:10]} {encoded[10:]}", "item")
    with pytest.raises(MediaError, match="no ','"):
        data_url_payload("data:image/png;base64", "item")


def test_formats_outside_vllms_allow_list_are_refused():
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "EPS") if "EPS" in Image.SAVE else pytest.skip("no EPS writer")
    with pytest.raises(MediaError, match="not a decodable image"):
        decode_vllm_image(buffer.getvalue(), 10**8, "item")
