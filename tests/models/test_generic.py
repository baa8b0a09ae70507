"""The generic path: a family no module declares (LLaVA here) is served exactly through its own
`get_image_features` and full processor; models whose rows cannot be counted are refused at start-up,
each refusal naming what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from encode_server.models.generic.adapter import FAMILY, GenericAdapter, generic_from_folder
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import FALLBACK_FAMILY, family_for_model_type, family_named, load_checkpoint
from tests.support.checkpoints.generic import blip2_checkpoint, llama_checkpoint, llava_checkpoint
from tests.support.checkpoints.llava_onevision import llava_onevision_checkpoint
from tests.support.family_fixtures import spliced_rows
from tests.support.helpers import ROOT, WITHOUT_TORCHVISION, rel_diff
from tests.support.tiny_parts import random_image

CPU, F32 = torch.device("cpu"), torch.float32
SIZES = [(50, 50), (120, 40), (33, 90)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoProcessor

    model, folder = llava_checkpoint(tmp_path_factory.mktemp("llava"))
    return model, folder, AutoProcessor.from_pretrained(folder), load_checkpoint(folder, CPU, F32)


def images():
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]


def test_an_undeclared_model_type_falls_back_to_the_generic_family(checkpoint):
    adapter = checkpoint[3]  # from registry.load_checkpoint
    assert family_for_model_type("llava") is None and family_named(FALLBACK_FAMILY) is FAMILY
    assert FAMILY.shard is None and isinstance(adapter, GenericAdapter)
    assert adapter.info.family == "llava" and adapter.info.hidden_size == 64


def test_fused_items_equal_get_image_features_alone(checkpoint):
    model, _, processor, adapter = checkpoint
    items = images()
    batch = adapter.processor.preprocess("image", items)
    assert batch.layouts == [adapter.processor.item_layout("image", image) for image in items]
    calls = []
    handle = adapter.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        fused = adapter.forward(batch)
    finally:
        handle.remove()
    assert adapter.batchable == {"image": True} and len(calls) == 1  # LLaVA's inputs join: one forward
    alone = []
    for image in items:
        with torch.no_grad():
            out = model.model.get_image_features(pixel_values=processor(images=[image], text=["<image>"],
                                                                        return_tensors="pt")["pixel_values"])
        alone.append(torch.cat([part.reshape(-1, part.shape[-1]) for part in out.pooler_output]))
    assert fused.shape[0] == 16 * len(items)
    assert rel_diff(fused, torch.cat(alone)) <= 1e-5


def test_rows_fill_exactly_the_image_tokens_the_full_processor_inserts(checkpoint):
    model, _, processor, adapter = checkpoint
    for image in images():
        inputs = processor(text=["describe <image> image"], images=[image], return_tensors="pt")
        placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
        rows = adapter.forward(adapter.processor.preprocess("image", [image]))
        assert adapter.processor.item_layout("image", image).tokens == placeholders == rows.shape[0]
        assert rel_diff(rows, spliced_rows(model, inputs, model.config.image_token_id)) <= 1e-5


def test_collate_joins_per_item_batches_in_order(checkpoint):
    adapter = checkpoint[3]
    items = images()
    collated = adapter.processor.collate([adapter.processor.preprocess("image", [image]) for image in items])
    assert collated.layouts == adapter.processor.preprocess("image", items).layouts
    assert torch.equal(adapter.forward(collated), adapter.forward(adapter.processor.preprocess("image", items)))


def test_a_processor_that_miscounts_its_own_tokens_is_refused(checkpoint, tmp_path):
    """num_additional_image_tokens=0 with a CLIP class token: the processor inserts 15 tokens, the model gives 16."""
    _, folder = llava_checkpoint(tmp_path / "miscount", num_additional_image_tokens=0)
    with pytest.raises(CheckpointError, match="no modality can be served exactly.*image: the model's forward fails"):
        generic_from_folder(folder, CPU, F32)


def test_a_text_only_model_is_refused_naming_why(tmp_path):
    folder = llama_checkpoint(tmp_path / "model")
    with pytest.raises(CheckpointError, match="'llama' is not a multimodal model"):
        generic_from_folder(folder, CPU, F32)


def test_a_processor_that_fails_on_its_own_checkpoint_is_refused_naming_it(tmp_path):
    """This BLIP-2 folder's processor raises on every prompt (its image token is a plain string where the processor
    expects an AddedToken): nothing can be counted, and the refusal says where it failed."""
    _, folder = blip2_checkpoint(tmp_path / "model")
    with pytest.raises(CheckpointError, match="image: its processor fails on a probe .AttributeError"):
        generic_from_folder(folder, CPU, F32)


REFUSAL_WITHOUT_TORCHVISION = """
import sys
from pathlib import Path
import torch
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.generic.adapter import generic_from_folder
try:
    generic_from_folder(Path(sys.argv[1]), torch.device("cpu"), torch.float32)
except CheckpointError as exc:
    print(exc)
    sys.exit(3)
"""


def test_a_processor_that_needs_torchvision_is_refused_on_a_machine_without_it(tmp_path):
    """LLaVA-OneVision's video processor needs torchvision: where it is missing (hidden here in a subprocess),
    the full processor does not load, so image tokens cannot be counted and the folder is refused."""
    _, folder = llava_onevision_checkpoint(tmp_path / "model")
    result = subprocess.run([sys.executable, "-c", REFUSAL_WITHOUT_TORCHVISION, str(folder)], cwd=ROOT,
                            env={**os.environ, **WITHOUT_TORCHVISION}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "full processor does not load here" in result.stdout


def test_a_model_type_transformers_does_not_know_is_refused(checkpoint, tmp_path):
    folder = tmp_path / "unknown"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no_such_vlm"}))
    with pytest.raises(CheckpointError, match="no_such_vlm"):
        load_checkpoint(folder, CPU, F32)


def test_audio_is_served_by_the_generic_path_framing_excluded(tmp_path):
    """A Qwen2-Audio folder loaded through the generic path (not its family): the rows are what the full model
    splices at its <|AUDIO|> tokens; the chat template's <|audio_bos|>/<|audio_eos|> framing is not counted."""
    import numpy as np

    from tests.support.checkpoints.qwen2_audio import qwen2_audio_checkpoint, qwen2_audio_full_processor

    model, extractor, folder = qwen2_audio_checkpoint(tmp_path / "model")
    full = qwen2_audio_full_processor(extractor)
    full.save_pretrained(folder)
    model.config.audio_token_id = full.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    model.save_pretrained(folder)
    adapter = generic_from_folder(folder, CPU, F32)
    assert adapter.info.modalities == ("audio",) and adapter.info.placeholder_tokens == {"audio": ["<|AUDIO|>"]}
    waves = [(np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32) for n in (8000, 21000)]
    fused = adapter.forward(adapter.processor.preprocess("audio", waves))
    expected = []
    for wave in waves:
        inputs = full(text=["<|audio_bos|><|AUDIO|><|audio_eos|>"], audio=[wave], sampling_rate=8000,
                      return_tensors="pt")
        expected.append(spliced_rows(model, inputs, model.config.audio_token_id))
        assert adapter.processor.item_layout("audio", wave).tokens == expected[-1].shape[0]
    assert [layout.tokens for layout in adapter.processor.preprocess("audio", waves).layouts] == [25, 66]
    assert rel_diff(fused, torch.cat(expected)) <= 1e-5


def test_a_server_on_a_generic_folder_answers_with_the_adapters_rows_through_a_preprocessing_worker(checkpoint):
    """The adapter pickled into a preprocessing worker counts and prepares items as in-process; `/server_info`
    names the tokens the rows fill."""
    import asyncio
    import base64
    import io

    import httpx
    import numpy as np

    from tests.support.helpers import ServerProcess

    _, folder, _, adapter = checkpoint
    items = images()
    want = [adapter.forward(adapter.processor.preprocess("image", [image])) for image in items]

    def png_b64(image) -> str:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return base64.b64encode(buffer.getvalue()).decode()

    async def send(url: str):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + "/encode", json={
                "req_id": f"r{index}", "modality": "image", "return_embedding": True, "mm_items": [png_b64(image)]})
                for index, image in enumerate(items)))

    with ServerProcess("--model", str(folder), "--preprocess-workers", "1") as server:
        info = httpx.get(server.url + "/server_info").json()
        responses = asyncio.run(send(server.url))
    assert info["model"]["family"] == "llava" and info["model"]["placeholder_tokens"] == {"image": ["<image>"]}
    for response, rows in zip(responses, want, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        got = np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"])
        assert got.shape == tuple(rows.shape) and rel_diff(got, rows) <= 1e-6


def test_video_is_served_by_the_generic_path_with_the_frames_as_sampled(tmp_path):
    """A LLaVA-OneVision folder loaded through the generic path (not its family), its video processor saved:
    a clip's rows are what the full model splices at its <video> tokens for those frames (no resampling)."""
    import numpy as np
    from transformers import AutoProcessor, LlavaOnevisionVideoProcessor

    from processors.video_clip import VideoClip

    pytest.importorskip("torchvision", reason="LLaVA-OneVision's video processor needs torchvision")
    model, folder = llava_onevision_checkpoint(tmp_path / "model")
    LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28}).save_pretrained(folder)
    adapter = generic_from_folder(folder, CPU, F32)
    assert adapter.info.modalities == ("image", "video")
    clips = [VideoClip([random_image(40, 30, 10 * n + i) for i in range(frames)], 2.0, range(0, 2 * frames, 2))
             for n, frames in enumerate((4, 6))]
    fused = adapter.forward(adapter.processor.preprocess("video", clips))
    full = AutoProcessor.from_pretrained(folder)
    expected = []
    for clip in clips:
        inputs = full(text=["<video>"], videos=[[np.asarray(frame) for frame in clip]], do_sample_frames=False,
                      return_tensors="pt")
        expected.append(spliced_rows(model, inputs, model.config.video_token_id))
        assert adapter.processor.item_layout("video", clip).tokens == expected[-1].shape[0]
    assert rel_diff(fused, torch.cat(expected)) <= 1e-5


def test_a_model_whose_features_are_not_deterministic_is_refused(checkpoint):
    """Noise in the features (as VibeVoice-ASR samples by default): two runs on the same probe differ, so no rows
    are the model's."""
    adapter = checkpoint[3]
    handle = adapter.model.model.multi_modal_projector.register_forward_hook(
        lambda module, args, output: output + 0.01 * torch.randn_like(output))
    try:
        with pytest.raises(CheckpointError, match="not deterministic"):
            adapter.filled_tokens("image", adapter.processor.prompts["image"])
    finally:
        handle.remove()
    assert adapter.filled_tokens("image", adapter.processor.prompts["image"]).tolist() == [4]


def test_features_mixed_with_the_text_embedding_otherwise_than_added_are_refused(checkpoint):
    """A model that mixes its features with the placeholder's text embedding in any way but adding that one row
    (Molmo2's way, served with the row read from the checkpoint) cannot be served without the language model's
    embedding table."""
    adapter = checkpoint[3]
    image_token = adapter.processor.filled["image"]
    handle = adapter.model.model.multi_modal_projector.register_forward_hook(
        lambda module, args, output: output + 2 * adapter.embedding(image_token).to(output.dtype))
    try:
        with pytest.raises(CheckpointError, match="mix the model's features with the text embedding"):
            adapter.filled_tokens("image", adapter.processor.prompts["image"])
    finally:
        handle.remove()


def test_features_added_onto_the_placeholders_own_embedding_are_told_apart(checkpoint):
    """Molmo2's way: the features plus the placeholder token's own embedding row; the probes name that token."""
    adapter = checkpoint[3]
    image_token = adapter.processor.filled["image"]
    handle = adapter.model.model.multi_modal_projector.register_forward_hook(
        lambda module, args, output: output + adapter.embedding(image_token).to(output.dtype))
    try:
        filled = adapter.filled_tokens("image", adapter.processor.prompts["image"])
    finally:
        handle.remove()
    assert image_token in filled.tolist() and adapter.added_tokens == [image_token]


def test_the_stand_in_embedding_tables_rows_by_index_are_its_rows():
    """Gemma 4 reads `embed_tokens.weight[pad_token_id, :]`: the stand-in answers with its own row for that id."""
    from encode_server.models.generic.language_model_trap import TextEmbedding

    embedding = TextEmbedding(8, torch.float32)
    embedding.pattern = True
    assert torch.equal(embedding.weight[5, :], embedding(torch.tensor(5)))
    assert torch.equal(embedding.weight[[1, 2]], embedding(torch.tensor([1, 2])))
    embedding.pattern = False
    assert not embedding.weight[5, :].any()
