"""What a family test module built on one tiny checkpoint shares: its module-scoped fixtures (`checkpoint`, the
builder's `(model, folder)`; `adapter`, the folder loaded as the server loads it; `processor`, the full
`transformers` processor of the folder) and the check that items fused into one forward get their rows alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.helpers import rel_diff

CPU, F32 = torch.device("cpu"), torch.float32


def checkpoint_fixtures(build: Callable[[Path], tuple], load: Callable[..., Any]):
    """`checkpoint, adapter, processor = checkpoint_fixtures(build, load)` in a test module: `build(root)` makes
    the checkpoint under a fresh temporary folder, `load(folder, device, dtype)` loads its adapter."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory):
        return build(tmp_path_factory.mktemp("checkpoint"))

    @pytest.fixture(scope="module")
    def adapter(checkpoint):
        return load(checkpoint[1], CPU, F32)

    @pytest.fixture(scope="module")
    def processor(checkpoint):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(checkpoint[1])

    return checkpoint, adapter, processor


def check_fused_equals_alone(adapter, modality: str, items: Sequence[Any], alone_rows: Callable[[Any], torch.Tensor]):
    """The items preprocessed and encoded in one forward give each exactly `alone_rows(item)` (1e-5 relative), with
    the layouts `item_layout` announces; returns the fused batch."""
    batch = adapter.processor.preprocess(modality, items)
    assert batch.layouts == [adapter.processor.item_layout(modality, item) for item in items]
    fused = adapter.forward(batch)
    alone = [alone_rows(item) for item in items]
    assert [layout.tokens for layout in batch.layouts] == [rows.shape[0] for rows in alone]
    assert fused.shape == (sum(rows.shape[0] for rows in alone), adapter.info.hidden_size)
    assert rel_diff(fused, torch.cat(alone)) <= 1e-5
    return batch


def spliced_rows(model, inputs: dict, image_token_id: int) -> torch.Tensor:
    """The rows the model's own forward puts at the image-token positions of `input_ids` (prompt 0)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    decoders = [name for name, _ in model.named_modules()
                if name.rpartition(".")[2] in ("language_model", "text_model")]
    decoder = model.get_submodule(min(decoders, key=lambda name: name.count(".")))
    handle = decoder.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return captured["embeds"][0][inputs["input_ids"][0] == image_token_id]


def check_server_fuses_audio_and_serves_images_and_video(folder: Path, family: str, sampling_rate: int,
                                                         waves: Sequence[Any], alone: Callable[[Any], torch.Tensor],
                                                         tokens: list[int], adapter, image, frames) -> None:
    """Through the real server on `folder`: the `waves` as audio requests fused in one forward, each answered with
    `alone(wave)`'s rows and its `tokens`; then an image and a video, each with the adapter's own rows."""
    import asyncio

    import httpx

    from tests.support.helpers import BATCHING, InProcessServer, embedding_of, png_b64, post_all
    from tests.support.tiny_parts import wav_b64

    def adapter_rows(modality, item):
        return adapter.forward(adapter.processor.preprocess(modality, [item]))

    with InProcessServer("--model", str(folder), *BATCHING) as server:
        info = httpx.get(server.url + "/server_info").json()["model"]
        assert info["family"] == family and info["modalities"] == ["image", "video", "audio"]
        bodies = [{"req_id": f"a{i}", "modality": "audio", "mm_items": [wav_b64(wave, sampling_rate)],
                   "return_embedding": True} for i, wave in enumerate(waves)]
        responses = asyncio.run(post_all(server.url, bodies))
        for response, wave in zip(responses, waves):
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["batch_size"] == len(waves)
            assert rel_diff(embedding_of(body), alone(wave)) <= 1e-5
        assert [response.json()["items"][0]["tokens"] for response in responses] == tokens
        for modality, item, expected in (("image", png_b64(image), adapter_rows("image", image)),
                                         ("video", {"frames": [png_b64(f) for f in frames]},
                                          adapter_rows("video", frames))):
            response = httpx.post(server.url + "/encode", timeout=60, json={
                "req_id": modality, "modality": modality, "mm_items": [item], "return_embedding": True})
            assert response.status_code == 200, response.text
            assert rel_diff(embedding_of(response.json()), expected) <= 1e-5
