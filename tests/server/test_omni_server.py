"""One real server serving an Omni model's three modalities, with preprocessing workers, over HTTP.

`tiny-qwen3-omni` with `--preprocess-workers 1`: images, a video (frames) and audio clips (WAV) from
concurrent requests come back with the rows of the adapter in this process (the worker's picklable
copy extracts the features, the server's tower runs them), each modality with its own row width and
deepstack; a clip too short for the model is a 400 for its own request only.
"""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import soundfile
import torch

from encode_server.models import BUILTIN_MODELS
from tests.support.checkpoints.qwen_omni import sample_audio, sample_clips, sample_images
from tests.support.helpers import ServerProcess, decode_embedding


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def wav_b64(clip: np.ndarray) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, clip, 16000, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_server_with_workers_answers_every_modality_with_the_adapters_rows():
    adapter = BUILTIN_MODELS["tiny-qwen3-omni"](torch.device("cpu"), torch.float32)
    images, clip, clips = sample_images()[:2], sample_clips()[1], sample_audio("qwen3_omni_moe")[1:4]
    requests = [
        ("image", [png_b64(image) for image in images], images),
        ("video", [{"frames": [png_b64(frame) for frame in clip]}], [clip]),
        ("audio", [wav_b64(clip) for clip in clips[:2]], clips[:2]),
        ("audio", [wav_b64(clips[2])], clips[2:]),
        ("audio", [wav_b64(np.zeros(100, dtype=np.float32))], None),
    ]

    async def post_all(url: str) -> list:
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(
                client.post(url + "/encode", json={"req_id": f"omni-{index}", "modality": modality,
                                                   "mm_items": items, "return_embedding": True})
                for index, (modality, items, _) in enumerate(requests)))

    with ServerProcess("--model", "tiny-qwen3-omni", "--preprocess-workers", "1", "--max-wait-ms", "50",
                       startup_timeout=300) as server:
        info = httpx.get(server.url + "/server_info", timeout=60).json()["model"]
        assert info["row_widths"] == {"image": 384, "video": 384, "audio": 128}
        responses = asyncio.run(post_all(server.url))
    for (modality, _, decoded), response in zip(requests, responses):
        if decoded is None:
            assert response.status_code == 400 and "too short" in response.json()["message"]
            continue
        assert response.status_code == 200, response.text
        body = response.json()
        want = adapter.forward(adapter.processor.preprocess(modality, decoded)).numpy()
        np.testing.assert_allclose(decode_embedding(body), want, rtol=1e-5, atol=1e-5)
        assert body.get("deepstack", 0) == adapter.info.deepstack_of(modality)
        if modality == "audio":
            assert [item["grid_thw"] for item in body["items"]] == [[1, 1, item["tokens"]] for item in body["items"]]
