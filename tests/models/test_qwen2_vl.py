"""The qwen2_vl family (Qwen2-VL): parity with the model's own features, the prefill side's token
count, and tensor parallelism, from a tiny full checkpoint saved with `save_pretrained`."""

from __future__ import annotations

import asyncio
import base64
import io
import shutil

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.models.registry import load_checkpoint
from tests.support.checkpoints.qwen_vl import qwen2_vl_checkpoint
from tests.support.helpers import ServerProcess, rel_diff
from tests.support.tiny_parts import install_reference_processor

CPU, F32 = torch.device("cpu"), torch.float32


def random_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2vl") / "ckpt")


@pytest.fixture(scope="module")
def adapter(ckpt):
    return load_checkpoint(ckpt[2], CPU, F32)


def image_features(model, processor, image) -> torch.Tensor:
    inputs = processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_grid_thw=inputs["image_grid_thw"])
    return torch.cat(out.pooler_output)


def test_images_alone_and_fused_match_get_image_features(ckpt, adapter):
    model, processor, _ = ckpt
    assert adapter.info.family == "qwen2_vl" and adapter.info.hidden_size == 96
    images = [random_image(w, h, seed) for seed, (w, h) in enumerate([(56, 56), (90, 40), (130, 200), (28, 300)])]
    want = [image_features(model, processor, image) for image in images]
    for subset in ([0, 1, 2, 3], [2, 0], [3]):
        batch = adapter.processor.preprocess("image", [images[i] for i in subset])
        assert [layout.tokens for layout in batch.layouts] == [want[i].shape[0] for i in subset]
        rows = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
        for index, got in zip(subset, rows):
            assert rel_diff(got, want[index]) <= 1e-5, (subset, index)
    assert [adapter.processor.item_layout("image", image).tokens for image in images] == [w.shape[0] for w in want]


def test_videos_alone_and_fused_match_get_video_features(ckpt, adapter):
    model, _, _ = ckpt
    clips = [[random_image(70, 50, 10 * c + f) for f in range(frames)] for c, frames in enumerate((5, 2, 3))]
    clips[1] = [random_image(100, 60, 50 + f) for f in range(2)]
    want = []
    for clip in clips:
        alone = adapter.processor.preprocess("video", [clip])
        with torch.no_grad():
            out = model.model.get_video_features(pixel_values_videos=alone.inputs["pixel_values"],
                                                 video_grid_thw=alone.inputs["grid_thw"])
        want.append(torch.cat(out.pooler_output))
    batch = adapter.processor.preprocess("video", clips)
    assert [layout.grid_thw[0] for layout in batch.layouts] == [3, 1, 2]
    pieces = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
    for got, expected, clip in zip(pieces, want, clips):
        assert rel_diff(got, expected) <= 1e-5
        assert adapter.processor.item_layout("video", clip).tokens == expected.shape[0]


def test_rows_equal_the_placeholders_the_full_processor_inserts(ckpt, tmp_path):
    # Counts from Qwen2VLProcessor (AutoProcessor.from_pretrained of this checkpoint saved with its full
    # processor and a tiny tokenizer; the video processor caps pixels per frame), recorded by
    # tools/reference/reference_prefill_counts.py because that processor needs torchvision.
    folder = shutil.copytree(ckpt[2], tmp_path / "with_full_processor")
    reference = install_reference_processor(folder, "qwen2_vl")
    assert list(reference["files"]) == ["processor_config.json"]  # nested image and video processors
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.processor.video.processor.cap_pixels_per_frame
    images = [random_image(w, h, i) for i, (w, h, _) in enumerate(reference["images"])]
    counts = [count for *_, count in reference["images"]]
    assert [adapter.processor.item_layout("image", image).tokens for image in images] == counts
    batch = adapter.processor.preprocess("image", images)
    assert [layout.tokens for layout in batch.layouts] == counts
    assert adapter.forward(batch).shape[0] == sum(counts)
    for frames, width, height, count in reference["videos"]:
        clip = [random_image(width, height, f) for f in range(frames)]
        assert adapter.processor.item_layout("video", clip).tokens == count, (frames, width, height)
        assert adapter.processor.preprocess("video", [clip]).layouts[0].tokens == count


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_tensor_parallel_over_two_ranks_equals_one(ckpt, adapter):
    images = [random_image(40 + 30 * i, 90 - 10 * i, 70 + i) for i in range(4)]
    want = [adapter.forward(adapter.processor.preprocess("image", [image])) for image in images]

    async def burst(url: str):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + "/encode", json={
                "req_id": f"tp{i}", "modality": "image", "mm_items": [png_b64(image)], "return_embedding": True})
                for i, image in enumerate(images)))

    with ServerProcess("--model", str(ckpt[2]), "--tp-size", "2", "--max-wait-ms", "300", "--min-batch-size",
                       "100", "--hard-timeout-additional-s", "0.2") as server:
        responses = asyncio.run(burst(server.url))
    for response, expected in zip(responses, want):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["batch_size"] == len(images)
        got = np.frombuffer(base64.b64decode(body["embedding"]), "<f4").reshape(body["embedding_shape"])
        assert rel_diff(got, expected) <= 1e-5
