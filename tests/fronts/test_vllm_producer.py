"""The vLLM producer end to end (`--ec-storage`): `POST /v1/chat/completions` as vLLM's EPD proxy sends it,
against a real server on loopback. What vLLM itself computes is checked in `tests/fronts/test_vllm_identifiers.py`
(identifiers, pixels) and by `tools/compat/vllm_compat.py` (vLLM's consumer loading what we wrote)."""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import http.server
import io
import threading
from pathlib import Path

import httpx
import torch
from PIL import Image
from safetensors.torch import load_file

from encode_server.fronts.vllm.identifiers import EncodedImage, image_identifier
from encode_server.fronts.vllm.images import decode_vllm_image
from tests.support import paths
from tests.support.helpers import InProcessServer, decode_embedding, png_bytes, vllm_audio_hash
from tests.support.vllm_requests import (
    CONSUMER_MODEL,
    data_url,
    frames_item,
    image_part,
    media_url,
    native_rows_of,
    proxy_body,
)

GOLDEN = paths.GOLDEN / "vllm-images"


def post(server, body, request_id: str = "req-1") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id},
                      timeout=60)


def stored(storage: Path) -> list[str]:
    return sorted(str(path.relative_to(storage)) for path in storage.rglob("*") if path.is_file())


def native_rows(server, image: Image.Image) -> torch.Tensor:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    response = httpx.post(f"{server.url}/encode", json={
        "req_id": "reference", "modality": "image", "mm_items": [base64.b64encode(buffer.getvalue()).decode()],
        "return_embedding": True}, timeout=60).json()
    return torch.from_numpy(decode_embedding(response).copy())


def test_proxy_requests_store_vllms_identifiers_and_rows(tmp_path):
    storage = tmp_path / "ec"
    transparent = (GOLDEN / "rgba.png").read_bytes()
    rotated = (GOLDEN / "exif6.jpg").read_bytes()
    plain = png_bytes(64, 48, 3)
    with InProcessServer("--ec-storage", str(storage), "--ec-model-id", "Qwen/Qwen2.5-VL-3B-Instruct") as server:
        for data in (plain, transparent, rotated):
            response = post(server, proxy_body(image_part(data_url(data))))
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-req-1"
            assert answer["choices"][0]["finish_reason"] == "length"
            decoded = decode_vllm_image(data, 10**8, "item")
            identifier = image_identifier("blake3", "Qwen/Qwen2.5-VL-3B-Instruct",
                                          EncodedImage(data, decoded.io_config))
            (item,) = answer["encoder_cache"]
            assert item["identifier"] == identifier and not item["hit"]
            rows = load_file(str(storage / identifier / "encoder_cache.safetensors"))["ec_cache"]
            assert item["tokens"] == rows.shape[0] == answer["usage"]["prompt_tokens"]
            # The rows of the pixels vLLM decodes (the transparent one composited on white), bit for bit.
            assert torch.equal(rows, native_rows(server, decoded.image))
        assert not any(".tmp" in name for name in stored(storage))


def test_hits_uuids_and_several_items_in_one_body(tmp_path):
    storage = tmp_path / "ec"
    first, second = png_bytes(40, 40, 1), png_bytes(56, 30, 2)
    with InProcessServer("--ec-storage", str(storage)) as server:
        response = post(server, proxy_body(image_part(data_url(first)), image_part(data_url(second), uuid="mine-2"),
                                           image_part(data_url(first))))
        assert response.status_code == 200, response.text
        items = response.json()["encoder_cache"]
        assert items[1]["identifier"] == "mine-2" and items[0]["identifier"] == items[2]["identifier"]
        assert [item["hit"] for item in items] == [False, False, False]
        assert server.metric("encoder_ec_storage_writes_total") == 2
        # Sent again: hits, nothing encoded or written; a uuid alone (no URL) names the stored item.
        forwards = server.metric("encoder_batch_size_count")
        again = post(server, proxy_body(image_part(data_url(first)), {"uuid": "mine-2", "image_url": None}))
        assert again.status_code == 200, again.text
        assert [item["hit"] for item in again.json()["encoder_cache"]] == [True, True]
        assert [item["tokens"] for item in again.json()["encoder_cache"]] == [items[0]["tokens"], items[1]["tokens"]]
        # A hit still carries the placeholder metadata (vLLM's proxy then sends the consumer the item by its
        # identifier, not the media); the uuid alone has no media to size it by.
        params = again.json()["ec_transfer_params"]
        assert params[items[0]["identifier"]]["metadata"] == response.json()["ec_transfer_params"][
            items[0]["identifier"]]["metadata"] != {}
        assert params["mine-2"]["metadata"] == {} and params["mine-2"]["item_indices"] == [1]
        assert server.metric("encoder_ec_storage_writes_total") == 2
        assert server.metric("encoder_ec_storage_hits_total") == 2
        assert server.metric("encoder_batch_size_count") == forwards
        assert server.metric("encoder_ec_storage_files") == 2
        assert server.metric("encoder_ec_storage_bytes") == sum(
            path.stat().st_size for path in storage.rglob("encoder_cache.safetensors"))
    # A restart finds them: the storage is a cache across restarts.
    with InProcessServer("--ec-storage", str(storage)) as server:
        response = post(server, proxy_body(image_part(data_url(second), uuid="mine-2")))
        assert response.json()["encoder_cache"][0]["hit"] and server.metric("encoder_ec_storage_files") == 2
        assert set(response.json()["ec_transfer_params"]["mine-2"]["metadata"]) == {"image_grid_thw"}


def test_bad_items_are_openai_errors_naming_them_and_write_nothing(tmp_path):
    storage = tmp_path / "ec"
    good = data_url(png_bytes(32, 32, 4))
    with InProcessServer("--ec-storage", str(storage)) as server:
        cases = [
            (proxy_body(image_part(good), image_part(data_url(b"\x89PNG not really"))), "messages[0].content[1]"),
            (proxy_body(image_part("data:image/png,rawbytes")), "only base64"),
            (proxy_body(image_part("ftp://example.invalid/cat.png")), "http(s) or data: URL"),
            (proxy_body({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
             "does not encode audio"),
            (proxy_body({"type": "image_embeds", "image_embeds": "AAAA"}), "image_embeds parts are not supported"),
            (proxy_body(image_part(good, uuid="../escape")), "uuid"),
            (proxy_body({"uuid": "never-stored", "image_url": None}), "never-stored"),
            ({"messages": "nope"}, "messages"),
        ]
        for body, needle in cases:
            response = post(server, body)
            assert 400 <= response.status_code < 500, response.text
            error = response.json()["error"]
            assert needle in error["message"] and error["code"] == response.status_code
            assert error["type"] == "BadRequestError"
        assert stored(storage) == [] and server.metric("encoder_ec_storage_writes_total") == 0
        not_json = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=30)
        assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]


def test_http_images_and_concurrent_proxy_requests(tmp_path):
    storage = tmp_path / "ec"
    files = {f"/{index}.png": png_bytes(30 + 5 * index, 60 - 2 * index, 10 + index) for index in range(16)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    media = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{media.server_address[1]}"
    try:
        with InProcessServer("--ec-storage", str(storage), "--allow-private-urls", "true") as server:
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                responses = list(pool.map(lambda name: post(server, proxy_body(image_part(base + name)), "same-id"),
                                          files))
            assert [response.status_code for response in responses] == [200] * 16
            for name, response in zip(files, responses):
                identifier = image_identifier("blake3", "tiny-qwen2.5-vl", EncodedImage(files[name]))
                assert response.json()["encoder_cache"][0]["identifier"] == identifier
                assert (storage / identifier / "encoder_cache.safetensors").is_file()
            assert server.metric("encoder_ec_storage_writes_total") == 16
            assert server.metric("encoder_batch_size_count") < 16 + 1  # batched with each other (and the probe)
    finally:
        media.shutdown()


def test_bound_and_minimum_age_with_metrics(tmp_path):
    storage = tmp_path / "ec"
    images = [png_bytes(28, 28, 100 + index) for index in range(5)]
    with InProcessServer("--ec-storage", str(tmp_path / "probe")) as server:
        post(server, proxy_body(image_part(data_url(images[0]))))
        size = int(server.metric("encoder_ec_storage_bytes"))
    with InProcessServer("--ec-storage", str(storage), "--ec-storage-bytes", str(2 * size),
                         "--ec-storage-min-age-s", "0") as server:
        identifiers = [post(server, proxy_body(image_part(data_url(image)))).json()["encoder_cache"][0]["identifier"]
                       for image in images]
        assert server.metric("encoder_ec_storage_evictions_total") == 3
        assert server.metric("encoder_ec_storage_files") == 2
        assert server.metric("encoder_ec_storage_bytes") <= 2 * size
        assert sorted(path.name for path in storage.iterdir()) == sorted(identifiers[-2:])
    with InProcessServer("--ec-storage", str(storage), "--ec-storage-bytes", str(size),
                         "--ec-storage-min-age-s", "3600") as server:
        post(server, proxy_body(image_part(data_url(images[0]))))
        assert server.metric("encoder_ec_storage_evictions_total") == 0  # all young: the bound waits
        assert server.metric("encoder_ec_storage_files") == 3


def test_without_ec_storage_the_endpoint_says_how_to_turn_it_on():
    with InProcessServer() as server:
        response = post(server, proxy_body(image_part(data_url(png_bytes(8, 8)))))
        assert response.status_code == 404 and "--ec-storage" in response.json()["error"]["message"]


# --- video and audio items ---------------------------------------------------------------------------

GOLDEN_ROOT = paths.GOLDEN
REFERENCE = __import__("json").loads((GOLDEN_ROOT / "vllm-0.33.0-identifiers.json").read_text())


def test_video_parts_store_vllms_identifiers_and_the_rows_of_vllms_frames(tmp_path):
    from encode_server.fronts.vllm.video import decode_vllm_jpeg_frames, decode_vllm_video

    storage = tmp_path / "ec"
    clip = (GOLDEN_ROOT / "vllm-videos" / "clip.mp4").read_bytes()
    avi = (GOLDEN_ROOT / "vllm-videos" / "clip.avi").read_bytes()
    jpegs = (GOLDEN_ROOT / "vllm-videos" / "frames.jpeg.b64").read_text()
    files = {"/clip.avi": avi}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = files.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "video/x-msvideo")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    media = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    cases = [  # (part, golden entry, vLLM's decode); tiny-qwen2.5-vl: Qwen2VLVideoProcessor, vLLM's qwen2_vl loader
        ({"type": "video_url", "video_url": {"url": media_url(clip, "video/mp4")}},
         REFERENCE["videos"]["clip.mp4"]["qwen2_vl"], decode_vllm_video(clip, "qwen2_vl", 10**8, 100, "x")),
        ({"type": "video_url", "video_url": {"url": f"http://127.0.0.1:{media.server_address[1]}/clip.avi"}},
         REFERENCE["videos"]["clip.avi"]["qwen2_vl"], decode_vllm_video(avi, "qwen2_vl", 10**8, 100, "x")),
        ({"type": "video_url", "video_url": {"url": "data:video/jpeg;base64," + jpegs}},
         REFERENCE["videos"]["frames.jpeg.b64"]["jpeg_sequence"], decode_vllm_jpeg_frames(jpegs, 10**8, "x")),
    ]
    try:
        with InProcessServer("--ec-storage", str(storage), "--ec-model-id", CONSUMER_MODEL,
                           "--allow-private-urls", "true") as server:
            for part, golden, video in cases:
                response = post(server, proxy_body(part))
                assert response.status_code == 200, response.text
                (item,) = response.json()["encoder_cache"]
                assert item["identifier"] == golden["identifiers"]["blake3"][CONSUMER_MODEL] and not item["hit"]
                rows = load_file(str(storage / item["identifier"] / "encoder_cache.safetensors"))["ec_cache"]
                assert item["tokens"] == rows.shape[0]
                # The rows of the frames vLLM samples (not of our own sampling of the file), bit for bit.
                assert torch.equal(rows, native_rows_of(server, "video", frames_item(video.frames)))
            assert server.metric("encoder_ec_storage_writes_total") == 3
            # A video and an image in one body: one job per modality, both stored.
            both = post(server, proxy_body(image_part(data_url(png_bytes(40, 30, 7))), cases[0][0]))
            assert both.status_code == 200, both.text
            assert [item["hit"] for item in both.json()["encoder_cache"]] == [False, True]
            # Sent again with a uuid naming the stored video: a hit, nothing fetched.
            again = post(server, proxy_body({"uuid": cases[0][1]["identifiers"]["blake3"][CONSUMER_MODEL],
                                             "video_url": None}))
            assert again.status_code == 200 and again.json()["encoder_cache"][0]["hit"], again.text
            for part, needle in [
                ({"type": "video_url", "video_url": {"url": media_url(b"not a video", "video/mp4")}},
                 "messages[0].content[0]: not a decodable video"),
                ({"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,!!!,AAAA"}}, "not valid base64"),
                ({"type": "audio_url", "audio_url": {"url": media_url(b"RIFF", "audio/wav")}}, "does not encode audio"),
                ({"type": "video_url"}, "video_url.url"),
            ]:
                response = post(server, proxy_body(part))
                assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text
            assert server.metric("encoder_ec_storage_writes_total") == 4
    finally:
        media.shutdown()


def test_audio_parts_store_vllms_identifiers_and_rows(tmp_path):
    storage = tmp_path / "ec"
    clips = {name: (GOLDEN_ROOT / "vllm-audio" / name).read_bytes() for name in REFERENCE["audio"]}
    with InProcessServer("--model", "tiny-qwen2-audio", "--ec-storage", str(storage),
                       "--ec-model-id", CONSUMER_MODEL) as server:
        parts = {
            "mono16k.wav": {"type": "input_audio", "input_audio": {
                "data": base64.b64encode(clips["mono16k.wav"]).decode(), "format": "wav"}},
            "stereo44k.flac": {"type": "audio_url", "audio_url": {"url": media_url(clips["stereo44k.flac"],
                                                                                   "audio/flac")}},
            "float22k.wav": {"type": "audio_url", "audio_url": {"url": media_url(clips["float22k.wav"],
                                                                                 "audio/wav")}},
        }
        # vLLM's waveforms on this CPU (a resampled clip's last bits depend on the CPU:
        # tests/fronts/test_vllm_identifiers.py checks them against the resampling itself), and the identifiers vLLM's
        # framing gives them; on the CPU the golden file was recorded on (and on every CPU for the clip vLLM does not
        # resample) vLLM's own.
        from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio

        resampler = Resampler()
        try:
            waveforms = {name: decode_vllm_audio(clip, 16000, 60.0, "x", resampler) for name, clip in clips.items()}
        finally:
            resampler.close()
        expected = {name: vllm_audio_hash("blake3", CONSUMER_MODEL, audio.samples) for name, audio in waveforms.items()}
        for name, audio in waveforms.items():
            if hashlib.sha256(audio.samples.tobytes()).hexdigest() == \
                    REFERENCE["audio"][name]["samples_sha256"]:
                assert expected[name] == REFERENCE["audio"][name]["identifiers"]["blake3"][CONSUMER_MODEL]
        assert expected["mono16k.wav"] == REFERENCE["audio"]["mono16k.wav"]["identifiers"]["blake3"][CONSUMER_MODEL]
        for name, part in parts.items():
            response = post(server, proxy_body(part))
            assert response.status_code == 200, response.text
            (item,) = response.json()["encoder_cache"]
            assert item["identifier"] == expected[name]
            rows = load_file(str(storage / item["identifier"] / "encoder_cache.safetensors"))["ec_cache"]
            assert item["tokens"] == rows.shape[0] > 0
        # The rows are those of vLLM's waveform (resampled as vLLM does), not of our own resampling.
        audio = waveforms["stereo44k.flac"]
        identifier = expected["stereo44k.flac"]
        rows = load_file(str(storage / identifier / "encoder_cache.safetensors"))["ec_cache"]
        assert torch.equal(rows, native_rows_of(server, "audio", base64.b64encode(audio.wav()).decode()))
        for part, needle in [
            ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"nope").decode(), "format": "wav"}},
             "messages[0].content[0]: not an audio file"),
            ({"type": "input_audio", "input_audio": "AAAA"}, "input_audio must be an object"),
            (image_part(data_url(png_bytes(8, 8))), "does not encode image"),
        ]:
            response = post(server, proxy_body(part))
            assert response.status_code == 400 and needle in response.json()["error"]["message"], response.text
        assert server.metric("encoder_ec_storage_writes_total") == 3
