"""Images decoded as vLLM decodes them, for the vLLM producer.

vLLM's consumer runs its own processor on the pixels its media loader gives it and reads our rows in
place of its encoder's, so ours must come from the same pixels. Its loader
(`vllm/multimodal/media/image.py`, `ImageMediaIO.load_bytes`, default `image_mode="RGB"`):

- opens the bytes with Pillow, restricted to an allow-list of still-image formats (no EPS, WMF, ...);
- turns the image upright by its EXIF orientation (`ImageOps.exif_transpose`; a failure there is
  ignored and the image is kept as stored);
- converts to RGB: an image with transparency (RGBA, LA, PA, or a `transparency` entry such as a PNG
  tRNS chunk) is composited on a white background, any other mode is `convert("RGB")`ed; vLLM 0.32 keeps an
  image that is RGB already as it is, a tRNS chunk included (`versions.py`);
- and, when that conversion made a new image, hashes `{"image_mode": "RGB", "rgba_background_color":
  (255, 255, 255)}` with the original bytes (`identifiers.EncodedImage.io_config`).

The producer encodes these pixels as they are. The native `/encode` decode (`decoding.decode_image`) drops the
alpha channel instead, so a transparent image gives other pixels there: where the item is decoded again in
another process (the preprocessing pool, other ranks), `VllmImage.file_bytes` gives the original bytes when the
two decodes agree (`native_equivalent`) and a lossless PNG of vLLM's pixels otherwise. `data:` URLs are read
as vLLM reads them (base64 only, strictly).
"""

from __future__ import annotations

import binascii
import contextlib
import io
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from encode_server.media import base64_codec as base64
from encode_server.media.decoding import MediaError

#: vLLM's `ALLOWED_IMAGE_FORMATS` (`vllm/multimodal/image.py`): Pillow plugins that decode in-process.
ALLOWED_IMAGE_FORMATS: tuple[str, ...] = (
    "AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF", "ICNS", "ICO", "IM",
    "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX", "PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI",
    "SPIDER", "SUN", "TGA", "TIFF", "WEBP", "XBM", "XPM", "XVTHUMB",
)

#: vLLM's defaults: `image_mode="RGB"`, `rgba_background_color=(255, 255, 255)`.
IMAGE_MODE = "RGB"
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class VllmImage:
    """An image as vLLM's loader leaves it: RGB pixels, and the decode settings vLLM hashes with the
    original bytes when it had to convert them (None when the file was RGB already)."""

    image: Image.Image
    io_config: dict[str, Any] | None
    native_equivalent: bool  # decoding.decode_image gives these same pixels from the original bytes

    def png(self) -> bytes:
        """The pixels as a lossless PNG (no EXIF): any decoder reads back exactly `image`."""
        buffer = io.BytesIO()
        self.image.save(buffer, "PNG", compress_level=1)
        return buffer.getvalue()

    def file_bytes(self, original: bytes) -> bytes:
        """Bytes the native decode reads back as exactly these pixels: `original` where the decodes agree."""
        return original if self.native_equivalent else self.png()


def data_url_payload(url: str, location: str) -> bytes:
    """The bytes of a `data:[<mediatype>][;<param>=<value>]*;base64,<data>` URL, as vLLM's
    `MediaConnector._load_data_url` reads it: only base64, strictly (no whitespace, right padding)."""
    spec, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError(location, f"invalid data URL {url[:32]!r}: no ',' before the payload")
    _media_type, sep, encoding = spec.rpartition(";")
    if not sep or encoding != "base64":
        raise MediaError(location, "only base64 data URLs are supported (data:<type>;base64,<data>), as in vLLM")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(location, f"the data URL's payload is not valid base64 ({exc})") from None


def has_transparency(image: Image.Image) -> bool:
    """vLLM's `_has_transparency`: RGBA, LA, PA, or a `transparency` entry (tRNS in P/L/RGB PNGs)."""
    return image.mode in ("RGBA", "LA", "PA") or "transparency" in getattr(image, "info", {})


def to_rgb(image: Image.Image, composite_rgb: bool = True) -> Image.Image:
    """vLLM's `convert_image_mode(image, "RGB")`: transparency composited on white; the same object back
    when it is RGB already (and, `composite_rgb` False as in vLLM 0.32, an RGB image with a tRNS chunk too)."""
    if image.mode == IMAGE_MODE and not composite_rgb:
        return image
    if has_transparency(image):
        if image.mode != "RGBA":
            image = image.convert("RGBA")
        converted = Image.new("RGB", image.size, BACKGROUND)
        converted.paste(image, mask=image.split()[3])
        return converted
    if image.mode == IMAGE_MODE:
        return image
    return image.convert(IMAGE_MODE)


def decode_vllm_image(data: bytes, max_pixels: int, location: str, composite_rgb: bool = True) -> VllmImage:
    """`data` decoded as vLLM's `ImageMediaIO.load_bytes` decodes it, within `max_pixels`; `composite_rgb`: an
    RGB image's tRNS chunk is composited on white (vLLM 0.33; 0.32 keeps the image as it is)."""
    if not data:
        raise MediaError(location, "empty image data")
    try:
        image = Image.open(io.BytesIO(data), formats=ALLOWED_IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise MediaError(location, f"image too large: {exc}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise MediaError(location, "not a decodable image (unknown, unsupported or corrupt format)") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise MediaError(location, f"image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise MediaError(location, f"image is {width}x{height} = {width * height} pixels, above the limit of "
                                   f"{max_pixels} (--max-image-pixels)")
    upright = False
    try:
        with contextlib.suppress(Exception):  # as vLLM's normalize_image: a bad EXIF keeps the image as stored
            image = ImageOps.exif_transpose(image)
            upright = True
        image.load()
        converted = to_rgb(image, composite_rgb)
    except Exception as exc:  # Pillow raises OSError, SyntaxError (broken PNG chunks), ValueError, ...
        raise MediaError(location, f"cannot decode image: {exc}") from None
    changed = converted is not image
    io_config = {"image_mode": IMAGE_MODE, "rgba_background_color": BACKGROUND} if changed else None
    # The native decode (exif_transpose, then convert("RGB")) agrees unless vLLM composited transparency
    # or kept an image whose EXIF it could not apply.
    native = upright and not (changed and has_transparency(image))
    if "transparency" in converted.info:  # vLLM 0.32 kept an RGB image with a tRNS chunk as it is
        # ...and its consumers' processors (transformers below 5.20, its pin) read those pixels as they are, where a
        # newer `convert_to_rgb` composites an image whose info names a transparent colour: the encoder gets the
        # pixels alone, and any other process a PNG of them without the chunk.
        converted = converted.copy()
        del converted.info["transparency"]
        native = False
    return VllmImage(converted, io_config, native_equivalent=native)
