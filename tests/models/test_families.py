"""Model families from real checkpoint folders, against what `transformers` computes itself.

Each family's tiny full model (language model included) is saved with `save_pretrained`; the
server's encoder is loaded from the folder, and its output must match `transformers` on the same
inputs within a relative difference of 1e-5 (float32), including requests batched together.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile
import torch

from encode_server.models import load_adapter
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import load_checkpoint
from tests.support.checkpoints.internvl import internvl_checkpoint, internvl_reference
from tests.support.checkpoints.qwen2_audio import qwen2_audio_checkpoint
from tests.support.checkpoints.qwen_vl import qwen25_vl_checkpoint, qwen_reference
from tests.support.helpers import (
    BATCHING,
    InProcessServer,
    embedding_of,
    png_b64,
    post_all,
    rel_diff,
    run_python_module,
)
from tests.support.tiny_parts import random_image

CPU, F32 = torch.device("cpu"), torch.float32


# --- references: what transformers computes --------------------------------------------------


def audio_reference(model, extractor, waves) -> torch.Tensor:
    """The audio rows exactly as `Qwen2AudioModel.forward` splices them into the prompt."""
    features = extractor(waves, sampling_rate=extractor.sampling_rate, return_attention_mask=True,
                         padding="max_length", return_tensors="pt")
    lengths = model.model.audio_tower._get_feat_extract_output_lengths(features["attention_mask"].sum(-1))[1]
    input_ids = torch.full((1, int(lengths.sum())), model.config.audio_token_id)
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    handle = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model.model(input_ids=input_ids, input_features=features["input_features"],
                        feature_attention_mask=features["attention_mask"])
    finally:
        handle.remove()
    return captured["embeds"][0]


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return qwen25_vl_checkpoint(tmp_path_factory.mktemp("qwen25vl"))


@pytest.fixture(scope="module")
def internvl_ckpt(tmp_path_factory):
    return internvl_checkpoint(tmp_path_factory.mktemp("internvl"))


@pytest.fixture(scope="module")
def audio_ckpt(tmp_path_factory):
    return qwen2_audio_checkpoint(tmp_path_factory.mktemp("qwen2audio"))


# --- in-process parity ------------------------------------------------------------------------

def test_qwen25_vl_folder_matches_get_image_features(qwen_ckpt):
    model, processor, folder = qwen_ckpt
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.info.family == "qwen2_5_vl" and adapter.info.hidden_size == 96
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate([(56, 56), (90, 40), (130, 200), (28, 300)])]
    got = adapter.forward(adapter.processor.preprocess("image", images))
    assert rel_diff(got, qwen_reference(model, processor, images)) <= 1e-5
    layouts = [adapter.processor.item_layout("image", image) for image in images]
    assert sum(layout.tokens for layout in layouts) == got.shape[0]


def test_qwen25_vl_video_frames_match_get_video_features(qwen_ckpt):
    model, _, folder = qwen_ckpt
    adapter = load_checkpoint(folder, CPU, F32)
    frames = [random_image(70, 50, seed) for seed in range(5)]
    batch = adapter.processor.preprocess("video", [frames])
    (grid_t, grid_h, grid_w), = batch.inputs["grid_thw"].tolist()
    assert grid_t == 3, "5 frames with temporal patch 2 make 3 temporal patches (last frame repeated)"
    got = adapter.forward(batch)
    with torch.no_grad():
        want = model.model.get_video_features(pixel_values_videos=batch.inputs["pixel_values"],
                                              video_grid_thw=batch.inputs["grid_thw"]).pooler_output
    assert rel_diff(got, torch.cat(want)) <= 1e-5
    assert adapter.processor.item_layout("video", frames).tokens == got.shape[0] == grid_t * grid_h * grid_w // 4


def test_two_identical_frames_encode_like_the_image(qwen_ckpt):
    model, processor, folder = qwen_ckpt
    # Give the video the image's pixel range, so the frame is resized exactly as the image is.
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}}))
    try:
        adapter = load_checkpoint(folder, CPU, F32)
    finally:
        (folder / "video_preprocessor_config.json").unlink()
    image = random_image(84, 112, 3)
    video_rows = adapter.forward(adapter.processor.preprocess("video", [[image, image]]))
    # 1e-5: our patch embedding is a matrix multiply, transformers' a Conv3d (summation order differs).
    assert rel_diff(video_rows, qwen_reference(model, processor, [image])) <= 1e-5


def test_internvl_folder_matches_get_image_features_in_tile_space(internvl_ckpt):
    model, processor, folder = internvl_ckpt
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.info.family == "internvl"
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate([(40, 40), (160, 50), (90, 90), (30, 120)])]
    batch = adapter.processor.preprocess("image", images)
    tiles = [layout.grid_thw[0] for layout in batch.layouts]
    assert tiles[0] == 1 and max(tiles) > 2, tiles
    assert all(layout.tokens == layout.grid_thw[0] * 9 for layout in batch.layouts)  # 6x6 patches, shuffled 0.5
    assert [adapter.processor.item_layout("image", image) for image in images] == batch.layouts
    got = adapter.forward(batch)
    assert rel_diff(got, internvl_reference(model, processor, images)) <= 1e-5


def test_internvl_tiles_as_the_full_processor_does_whatever_the_image_processor_config_says(internvl_ckpt, tmp_path):
    """`InternVLProcessor` calls its image processor with `crop_to_patches=True`: a folder whose image processor
    config says false is still served per tile, as the prefill side counts it."""
    import json
    import shutil

    _, _, folder = internvl_ckpt
    untiled = tmp_path / "untiled"
    shutil.copytree(folder, untiled)
    config_path = untiled / "preprocessor_config.json"
    config = json.loads(config_path.read_text())
    config["crop_to_patches"] = False
    config_path.write_text(json.dumps(config))
    adapter = load_checkpoint(untiled, CPU, F32)
    assert adapter.processor.image_processor.crop_to_patches is False
    wide = random_image(160, 50, 1)
    expected = adapter.processor.image_processor.get_number_of_image_patches(50, 160, {"crop_to_patches": True})
    assert expected > 1 and adapter.processor.item_layout("image", wide).grid_thw[0] == expected
    assert adapter.processor.preprocess("image", [wide]).layouts == [adapter.processor.item_layout("image", wide)]


def test_qwen2_audio_folder_matches_the_models_own_forward(audio_ckpt):
    model, extractor, folder = audio_ckpt
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.info.family == "qwen2_audio" and adapter.processor.sampling_rate == 8000
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (8000, 2500, 47000)]
    batch = adapter.processor.preprocess("audio", waves)
    assert [adapter.processor.item_layout("audio", wave) for wave in waves] == batch.layouts
    got = adapter.forward(batch)
    assert rel_diff(got, audio_reference(model, extractor, waves)) <= 1e-5
    alone = torch.cat([adapter.forward(adapter.processor.preprocess("audio", [wave])) for wave in waves])
    assert rel_diff(alone, got) <= 1e-6, "a clip must not depend on its batch neighbours"


# --- loading: shards, only the encoder's tensors, clear errors -----------------------------------

def test_sharded_checkpoint_loads_without_the_language_model_shards(tmp_path):
    model, processor, folder = qwen25_vl_checkpoint(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    encoder_files = {name for key, name in index.items() if key.startswith(("visual.", "model.visual."))}
    language_only = set(index.values()) - encoder_files
    assert len(set(index.values())) > 3 and language_only
    for name in language_only:
        (folder / name).unlink()  # the loader must never need them
    adapter = load_checkpoint(folder, CPU, F32)
    images = [random_image(60, 60, 1)]
    assert rel_diff(adapter.forward(adapter.processor.preprocess("image", images)),
                    qwen_reference(model, processor, images)) <= 1e-5


def test_missing_encoder_tensors_unknown_type_and_empty_folder_are_clear_errors(tmp_path):
    _, _, folder = qwen25_vl_checkpoint(tmp_path / "broken", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = next(name for key, name in index.items() if key.startswith("visual.blocks.0"))
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match="shard|lacks"):
        load_checkpoint(folder, CPU, F32)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llava_next"}))
    with pytest.raises(CheckpointError, match="llava_next"):
        load_checkpoint(folder, CPU, F32)
    with pytest.raises(CheckpointError, match="config.json"):
        load_adapter(str(tmp_path), "cpu", "float32")


def test_checkpoint_without_encoder_keys_names_them(tmp_path):
    from safetensors.torch import save_file

    _, _, folder = internvl_checkpoint(tmp_path / "nolm")
    (folder / "model.safetensors").unlink()
    save_file({"language_model.model.norm.weight": torch.ones(4)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks \d+ encoder tensors: multi_modal_projector"):
        load_checkpoint(folder, CPU, F32)


def test_bad_checkpoint_folder_fails_at_start_with_a_message(tmp_path):

    result = run_python_module("encode_server", "--model", str(tmp_path), "--port", "0", timeout=120)
    assert result.returncode != 0 and "config.json" in result.stderr


# --- through the server: fused requests from checkpoint folders ---------------------------------


def test_qwen_folder_served_fused_images_and_a_video(qwen_ckpt):
    model, processor, folder = qwen_ckpt
    sizes = [(56, 56), (84, 140), (200, 90), (60, 61), (150, 150), (33, 90)]
    requests = [[random_image(*sizes[(i + k) % 6], seed=10 * i + k) for k in range(1 + i % 2)] for i in range(6)]
    with InProcessServer("--model", str(folder), *BATCHING) as server:
        info = httpx.get(server.url + "/server_info").json()["model"]
        assert info["family"] == "qwen2_5_vl" and info["modalities"] == ["image", "video"]
        bodies = [{"req_id": f"q{i}", "modality": "image", "mm_items": [png_b64(im) for im in images],
                   "return_embedding": True} for i, images in enumerate(requests)]
        responses = asyncio.run(post_all(server.url, bodies))
        for response, images in zip(responses, requests):
            assert response.status_code == 200, response.text
            assert response.json()["batch_size"] == len(requests)
            assert rel_diff(embedding_of(response.json()), qwen_reference(model, processor, images)) <= 1e-5
        frames = [random_image(64, 48, seed) for seed in range(3)]
        video = httpx.post(server.url + "/encode", timeout=60, json={
            "req_id": "v", "modality": "video", "return_embedding": True,
            "mm_items": [{"frames": [png_b64(f) for f in frames]}]}).json()
        assert video["items"][0]["grid_thw"][0] == 2 and video["batch_size"] == 1
        adapter = load_checkpoint(folder, CPU, F32)
        assert rel_diff(embedding_of(video), adapter.forward(adapter.processor.preprocess("video", [frames]))) <= 1e-5


def test_internvl_folder_served_fuses_requests_with_different_tile_counts(internvl_ckpt):
    model, processor, folder = internvl_ckpt
    requests = [[random_image(40 + 50 * i, 40 + 17 * (i % 3), seed=i)] for i in range(6)]
    with InProcessServer("--model", str(folder), *BATCHING) as server:
        bodies = [{"req_id": f"t{i}", "modality": "image", "mm_items": [png_b64(im) for im in images],
                   "return_embedding": True} for i, images in enumerate(requests)]
        responses = asyncio.run(post_all(server.url, bodies))
        tiles = set()
        for response, images in zip(responses, requests):
            body = response.json()
            assert response.status_code == 200 and body["batch_size"] == len(requests), response.text
            tiles.add(body["items"][0]["grid_thw"][0])
            assert body["items"][0]["tokens"] == body["items"][0]["grid_thw"][0] * 9
            assert rel_diff(embedding_of(body), internvl_reference(model, processor, images)) <= 1e-5
        assert len(tiles) > 1, "the burst should mix tile counts"


def audio_file(wave: np.ndarray, rate: int, fmt: str) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format=fmt)
    return buffer.getvalue()


def test_audio_folder_served_resamples_and_fuses_wav_flac_ogg(audio_ckpt):
    import librosa

    model, extractor, folder = audio_ckpt
    rng = np.random.default_rng(5)
    clips = [
        (audio_file(rng.standard_normal((44100, 2)).astype(np.float32) * 0.1, 44100, "WAV"), "wav 44.1k stereo"),
        (audio_file(rng.standard_normal(12000).astype(np.float32) * 0.1, 8000, "FLAC"), "flac at the model rate"),
        (audio_file(np.sin(np.linspace(0, 900, 33075)).astype(np.float32) * 0.3, 22050, "OGG"), "ogg 22.05k"),
    ]
    expected = []
    for data, _ in clips:
        wave, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        mono = wave.mean(axis=1)
        if rate != 8000:
            mono = librosa.resample(mono, orig_sr=rate, target_sr=8000)
        expected.append(audio_reference(model, extractor, [mono.astype(np.float32)]))
    with InProcessServer("--model", str(folder), *BATCHING) as server:
        bodies = [{"req_id": f"a{i}", "modality": "audio", "mm_items": [base64.b64encode(data).decode()],
                   "return_embedding": True} for i, (data, _) in enumerate(clips)]
        responses = asyncio.run(post_all(server.url, bodies))
        for response, want, (_, label) in zip(responses, expected, clips):
            assert response.status_code == 200, (label, response.text)
            assert response.json()["batch_size"] == len(clips), label
            assert rel_diff(embedding_of(response.json()), want) <= 1e-5, label
        too_long = audio_file(np.zeros(8000 * 7, dtype=np.float32), 8000, "WAV")
        refused = httpx.post(server.url + "/encode", json={
            "req_id": "long", "modality": "audio", "mm_items": [base64.b64encode(too_long).decode()]})
        assert refused.status_code == 400 and "mm_items[0]" in refused.json()["message"]
        assert "6 s" in refused.json()["message"]
        wrong = httpx.post(server.url + "/encode", json={
            "req_id": "img", "modality": "image", "mm_items": [png_b64(random_image(20, 20, 0))]})
        assert wrong.status_code == 400 and "audio" in wrong.json()["message"]


def test_builtin_families_serve_and_video_files_decode(tmp_path):
    import av

    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for index in range(20):  # 2 s at 10 fps
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 12, dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    with InProcessServer("--video-fps", "2", "--max-video-frames", "8") as server:
        response = httpx.post(server.url + "/encode", timeout=60, json={
            "req_id": "mp4", "modality": "video", "mm_items": [base64.b64encode(path.read_bytes()).decode()]})
        assert response.status_code == 200, response.text
        assert response.json()["items"][0]["grid_thw"][0] == 2  # 4 frames sampled at 2 fps, 2 per patch
        too_many = httpx.post(server.url + "/encode", json={
            "req_id": "frames", "modality": "video",
            "mm_items": [{"frames": [png_b64(random_image(28, 28, i)) for i in range(9)]}]})
        assert too_many.status_code == 400 and "limit of 8" in too_many.json()["message"]
    for name, modality in (("tiny-internvl", "image"), ("tiny-qwen2-audio", "audio")):
        with InProcessServer("--model", name) as server:
            info = httpx.get(server.url + "/server_info").json()["model"]
            assert info["name"] == name and info["modalities"] == [modality]
            item = (png_b64(random_image(120, 60, 1)) if modality == "image"
                    else base64.b64encode(audio_file(np.zeros(16000, np.float32), 16000, "WAV")).decode())
            response = httpx.post(server.url + "/encode", json={"req_id": name, "modality": modality,
                                                                "mm_items": [item]})
            assert response.status_code == 200, response.text
            assert response.json()["embedding_shape"][1] == 128
