"""vLLM's item identifiers and decoded pixels, against what vLLM 0.33.0 itself computed.

`tests/golden/vllm-0.33.0-identifiers.json` was written by `tools/reference/vllm_golden.py generate` (vLLM's
`ImageMediaIO.load_bytes` and `ProcessorInputs.get_mm_hashes`) for the tiny images in
`tests/golden/vllm-images/`: one per decode path (RGB, transparent RGBA, palette with tRNS, grayscale,
EXIF-rotated JPEG, CMYK JPEG); and for the clips in `vllm-videos/` (each through every video loader the
producer implements: sampled frames, metadata, identifiers) and `vllm-audio/` (waveforms after vLLM's
resampling to 16 kHz, identifiers).
"""

from __future__ import annotations

import hashlib
import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from encode_server.fronts.vllm.identifiers import EncodedImage, hash_kwargs, image_identifier
from encode_server.fronts.vllm.images import data_url_payload, decode_vllm_image
from encode_server.media.decoding import MediaError, decode_image
from tests.support import paths
from tests.support.helpers import vllm_audio_hash

pytestmark = pytest.mark.quick

GOLDEN = paths.GOLDEN
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


# --- videos and audio clips (`fronts.vllm.video`, `fronts.vllm.audio`) ------------------------------------

VIDEOS = sorted(REFERENCE["videos"])
AUDIO = sorted(REFERENCE["audio"])
VIDEO_CASES = [(name, loader) for name in VIDEOS for loader in REFERENCE["videos"][name]]


def test_the_golden_set_covers_every_video_loader_and_audio_path():
    assert set(VIDEOS) == {"clip.mp4", "clip.avi", "frames.jpeg.b64"}
    assert {loader for _, loader in VIDEO_CASES} == {"opencv", "qwen2_vl", "qwen3_vl", "opencv_dynamic",
                                                     "jpeg_sequence"}
    assert set(AUDIO) == {"mono16k.wav", "stereo44k.flac", "float22k.wav"}
    assert {REFERENCE["audio"][name]["native_rate"] for name in AUDIO} == {16000, 22050, 44100}
    sizes = [path.stat().st_size for folder in ("vllm-videos", "vllm-audio") for path in (GOLDEN / folder).iterdir()]
    assert sum(sizes) < 48 * 1024


def _video(name: str, loader: str):
    from encode_server.fronts.vllm.video import decode_vllm_jpeg_frames, decode_vllm_video

    data = (GOLDEN / "vllm-videos" / name).read_bytes()
    if loader == "jpeg_sequence":
        return decode_vllm_jpeg_frames(data.decode(), 10**8, "item")
    return decode_vllm_video(data, loader, 10**8, 1000, "item")


@pytest.mark.parametrize(("name", "loader"), VIDEO_CASES)
def test_video_frames_and_metadata_are_vllms(name, loader):
    expected = REFERENCE["videos"][name][loader]
    video = _video(name, loader)
    assert list(video.frames.shape) == expected["shape"] and video.frames.dtype == np.uint8
    assert hashlib.sha256(np.ascontiguousarray(video.frames).tobytes()).hexdigest() == expected["frames_sha256"]
    assert video.metadata == expected["metadata"]


@pytest.mark.parametrize(("name", "loader"), VIDEO_CASES)
@pytest.mark.parametrize("algorithm", ["blake3", "sha256", "sha512"])
def test_video_identifiers_are_vllms(name, loader, algorithm):
    from encode_server.fronts.vllm.identifiers import EncodedVideo, video_identifier

    video = _video(name, loader)
    item = EncodedVideo(video.original_bytes, video.frames, video.metadata)
    for model_id, identifier in REFERENCE["videos"][name][loader]["identifiers"][algorithm].items():
        assert video_identifier(algorithm, model_id, item) == identifier
    assert video_identifier(algorithm, "any", item, "mine") == "mine"


def test_video_sampling_rules_follow_vllms_loaders():
    from encode_server.fronts.vllm.video import frames_to_sample

    # Qwen2-VL: total / fps * 2, floored to even, at least 4 (a 451-frame clip's float32 tail clamped)
    assert frames_to_sample("qwen2_vl", 300, 30.0, 10.0) == list(range(0, 300, 15))
    assert frames_to_sample("qwen2_vl", 451, 30.0, 451 / 30)[-1] <= 450
    # Qwen3-VL: int(total / fps * 2) frames from linspace, rounded
    assert frames_to_sample("qwen3_vl", 300, 30.0, 10.0) == np.linspace(0, 299, 20).round().astype(int).tolist()
    # vLLM's default: 32 frames spread evenly, all of a shorter clip
    assert frames_to_sample("opencv", 100, 25.0, 4.0) == np.linspace(0, 99, 32, dtype=int).tolist()
    assert frames_to_sample("opencv", 7, 25.0, 0.28) == list(range(7))
    with pytest.raises(ValueError, match="fps"):
        frames_to_sample("qwen2_vl", 10, 0.0, 0)


def test_the_video_loader_follows_the_model_s_video_processor(tmp_path):
    from encode_server.fronts.vllm.video import UnsupportedVideoLoader, loader_for, video_processor_name

    assert video_processor_name(None, "qwen2_5_vl") == "Qwen2VLVideoProcessor"
    assert video_processor_name(None, "qwen3_vl") == "Qwen3VLVideoProcessor"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl"}')
    assert video_processor_name(str(tmp_path), None) == "Qwen3VLVideoProcessor"
    (tmp_path / "video_preprocessor_config.json").write_text('{"video_processor_type": "Qwen2VLVideoProcessor"}')
    assert video_processor_name(str(tmp_path), None) == "Qwen2VLVideoProcessor"
    assert [loader_for(name) for name in ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor", "Glm4vVideoProcessor",
                                          "LlavaOnevisionVideoProcessor", None)] == \
        ["qwen2_vl", "qwen3_vl", "opencv_dynamic", "opencv", "opencv"]
    with pytest.raises(UnsupportedVideoLoader, match="glm5_next"):
        loader_for("Glm5NextVideoProcessor")


def test_broken_videos_are_media_errors_naming_the_item():
    from encode_server.fronts.vllm.video import decode_vllm_video

    with pytest.raises(MediaError, match="item: not a decodable video"):
        decode_vllm_video(b"\x00\x00\x00\x18ftypmp42 not really", "qwen2_vl", 10**8, 100, "item")
    clip = (GOLDEN / "vllm-videos" / "clip.mp4").read_bytes()
    with pytest.raises(MediaError, match="--max-video-frames"):
        decode_vllm_video(clip, "opencv", 10**8, 4, "item")
    with pytest.raises(MediaError, match="--max-image-pixels"):
        decode_vllm_video(clip, "opencv", 100, 100, "item")


@pytest.fixture(scope="module")
def resampler():
    from encode_server.fronts.vllm.audio import Resampler

    pool = Resampler()
    yield pool
    pool.close()


# The waveform vLLM hashes for a resampled clip is torchaudio's float32 resampling, whose last bits depend on
# the CPU (its vector units and the order of the convolution's sums): on this CPU vLLM 0.33's own parser gives
# the samples the server writes, but not the bits the golden file was recorded with on another. So a resampled
# clip is checked against what the resampling must be on any CPU (the band-limited interpolation computed in
# float64, within float32 rounding), and its identifiers against vLLM's framing of these very samples
# (`helpers.vllm_audio_hash`); the framing itself is checked bit for bit against vLLM's own identifiers on the clip
# vLLM does not resample. vLLM's own parser and hasher on the machine itself (torchaudio included) are run against
# the server by tools/compat/vllm_compat.py.


def band_limited_resample(samples: np.ndarray, orig: int, new: int, rolloff: float = 0.99, zeros: int = 6):
    """torchaudio's `Resample(orig, new)` (sinc interpolation, Hann window, `zeros` zero crossings, `rolloff`)
    as its formula, in float64: output j at time j/new (in units of the reduced rates) is the sum over input i
    of x[i] * base/orig * sinc(t) * cos(pi t / 2 zeros)^2, t = base (i/orig - j/new), |t| < zeros, where
    base = min(orig, new) * rolloff. Also returns each output's sum of |terms|, which bounds its float32
    rounding."""
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    base = min(orig, new) * rolloff
    x = np.asarray(samples, dtype=np.float64)
    outputs = np.arange(math.ceil(new * len(x) / orig))
    reach = zeros * orig / base
    first = np.ceil(outputs * orig / new - reach).astype(int)
    inputs = first[:, None] + np.arange(int(math.ceil(2 * reach)) + 2)[None, :]
    t = base * (inputs / orig - outputs[:, None] / new)
    used = (np.abs(t) < zeros) & (inputs >= 0) & (inputs < len(x))
    sinc = np.sinc(t)  # sin(pi t) / (pi t), 1 at 0
    kernel = np.where(used, sinc * np.cos(np.clip(t, -zeros, zeros) * np.pi / zeros / 2) ** 2 * base / orig, 0.0)
    terms = kernel * np.where(used, x[np.clip(inputs, 0, len(x) - 1)], 0.0)
    return terms.sum(axis=1), np.abs(terms).sum(axis=1), int(used.sum(axis=1).max())


def float32_tolerance(magnitudes: np.ndarray, taps: int) -> float:
    """How far float32 arithmetic may move one output, a dot product of `taps` terms: the classic worst case of
    its rounding (taps x float32's epsilon / 2, relative to the sum of the terms' magnitudes, plus the
    coefficients' own rounding), times four, with the largest sum of magnitudes of the clip."""
    return 2 * taps * float(np.finfo(np.float32).eps) * float(magnitudes.max())


def native_samples(name: str) -> tuple[np.ndarray, int]:
    from encode_server.fronts.vllm.audio import decode_vllm_audio_native

    return decode_vllm_audio_native((GOLDEN / "vllm-audio" / name).read_bytes(), 60.0, "item")


def test_the_framing_of_an_audio_array_is_vllms_bit_for_bit():
    """On the clip vLLM does not resample (16 kHz), its samples are CPU-independent and vLLM's identifiers hold
    on any machine: the framing written out above reproduces every one of them."""
    expected = REFERENCE["audio"]["mono16k.wav"]
    samples, rate = native_samples("mono16k.wav")
    assert rate == REFERENCE["audio_rate"]
    assert hashlib.sha256(samples.tobytes()).hexdigest() == expected["samples_sha256"]
    checked = 0
    for algorithm, by_model in expected["identifiers"].items():
        for model_id, identifier in by_model.items():
            assert vllm_audio_hash(algorithm, model_id, samples) == identifier
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize("name", AUDIO)
def test_audio_waveforms_and_identifiers_are_vllms(name, resampler):
    from encode_server.fronts.vllm.audio import decode_vllm_audio
    from encode_server.fronts.vllm.identifiers import audio_identifier

    expected = REFERENCE["audio"][name]
    audio = decode_vllm_audio((GOLDEN / "vllm-audio" / name).read_bytes(), REFERENCE["audio_rate"], 60.0, "item",
                              resampler)
    samples = audio.samples
    assert samples.shape == (expected["samples"],) and samples.dtype.str == expected["dtype"]
    native, rate = native_samples(name)
    assert rate == expected["native_rate"]
    if rate == REFERENCE["audio_rate"]:
        assert np.array_equal(samples, native)  # not resampled: vLLM's bits on any CPU
    else:
        reference, magnitudes, taps = band_limited_resample(native, rate, REFERENCE["audio_rate"])
        error = np.abs(samples.astype(np.float64) - reference)
        tolerance = float32_tolerance(magnitudes, taps)
        assert error.max() <= tolerance, \
            f"{name}: {error.max():.3g} from the resampling in float64 (at most {tolerance:.3g})"
    recorded_here = hashlib.sha256(samples.tobytes()).hexdigest() == expected["samples_sha256"]
    for algorithm, by_model in expected["identifiers"].items():
        for model_id, identifier in by_model.items():
            ours = audio_identifier(algorithm, model_id, samples)
            assert ours == vllm_audio_hash(algorithm, model_id, samples)
            if recorded_here:  # the CPU the golden file was recorded on (and every CPU for the 16 kHz clip)
                assert ours == identifier
    # What the encoder is sent reads back as exactly these samples, with no resampling.
    from encode_server.media.decoding import decode_audio

    assert np.array_equal(decode_audio(audio.wav(), REFERENCE["audio_rate"], 60.0, "item"), samples)


def test_the_resampling_tolerance_tells_a_different_resampler_apart():
    """The float32 tolerance is far below what a different filter gives: a roll-off of 0.95 instead of
    0.99, or 5 zero crossings instead of 6, is more than 100 times outside it."""
    for name in ("float22k.wav", "stereo44k.flac"):
        native, rate = native_samples(name)
        reference, magnitudes, taps = band_limited_resample(native, rate, REFERENCE["audio_rate"])
        tolerance = float32_tolerance(magnitudes, taps)
        for variant in ({"rolloff": 0.95}, {"zeros": 5}):
            other, _, _ = band_limited_resample(native, rate, REFERENCE["audio_rate"], **variant)
            assert np.abs(other - reference).max() > 100 * tolerance, (name, variant)


def test_audio_limits_and_bad_files(resampler):
    from encode_server.fronts.vllm.audio import decode_vllm_audio

    clip = (GOLDEN / "vllm-audio" / "mono16k.wav").read_bytes()
    with pytest.raises(MediaError, match="--max-audio-seconds"):
        decode_vllm_audio(clip, 16000, 0.05, "item", resampler)
    with pytest.raises(MediaError, match="item: not an audio file"):
        decode_vllm_audio(b"RIFF....WAVEnope", 16000, 60.0, "item", resampler)
