"""GLM-4.1V / 4.5V (`glm4v`, `glm4v_moe`) from real checkpoint folders, against `transformers` itself.

1. Parity: an item's rows equal the model's own `get_image_features` / `get_video_features` for
   that item alone, within 1e-5 relative, also when items of different sizes are fused into one
   `preprocess` + `forward` (a video's temporal groups reach the tower as separate items, as
   `get_video_features` flattens them).
2. The prefill side's count: an item's rows equal the number of image tokens the full
   `Glm4vProcessor` puts into `input_ids` for it (a video's frames are filled with image tokens);
   and a video's pixels equal those of `transformers`' own (torchvision) video processor. Both
   need torchvision, which this venv lacks, so they were computed by
   `scripts/processor_reference.py` on the same folders and media
   (`tests/data/processor_reference.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from processors.glm4v import FAMILY
from processors.registry import family_for_model_type

from .helpers import rel_diff
from .vlm_fixtures import (
    CLIP_SIZES,
    IMAGE_SIZES,
    LAYOUTS,
    checkpoint_folders,
    fingerprint,
    sample_clips,
    sample_images,
)

CPU, F32 = torch.device("cpu"), torch.float32
MODEL_TYPES = ("glm4v", "glm4v_moe")
REFERENCE = json.loads((Path(__file__).parent / "data" / "processor_reference.json").read_text())["folders"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4v")
    return {model_type: checkpoint_folders(root, model_type, seed=30 + index)
            for index, model_type in enumerate(MODEL_TYPES)}


@pytest.fixture(scope="module")
def adapters(checkpoints):
    return {(model_type, layout): FAMILY.load(folder, CPU, F32)
            for model_type, (_, folders) in checkpoints.items() for layout, folder in folders.items()}


def test_the_registry_serves_glm4v_and_its_moe_twin():
    assert family_for_model_type("glm4v") is FAMILY and family_for_model_type("glm4v_moe") is FAMILY


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_images_equal_get_image_features_alone(checkpoints, adapters, model_type):
    from transformers import AutoImageProcessor

    model, folders = checkpoints[model_type]
    adapter = adapters[model_type, "nested"]
    assert adapter.info.deepstack == 0 and adapter.info.hidden_size == model.config.vision_config.out_hidden_size
    processor = AutoImageProcessor.from_pretrained(folders["nested"])
    images = sample_images()
    batch = adapter.preprocess("image", images)
    pieces = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
    for image, got in zip(images, pieces, strict=True):
        inputs = processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            want = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_grid_thw=inputs["image_grid_thw"]).pooler_output[0]
        assert got.shape == want.shape
        assert rel_diff(got, want) <= 1e-5


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_videos_equal_get_video_features_alone(checkpoints, adapters, model_type):
    model, _ = checkpoints[model_type]
    adapter = adapters[model_type, "nested"]
    clips = sample_clips()
    batch = adapter.preprocess("video", clips)
    pieces = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
    for clip, got in zip(clips, pieces, strict=True):
        pixels, layout = adapter.video.patches(clip)
        with torch.no_grad():
            want = model.model.get_video_features(pixel_values_videos=pixels,
                                                  video_grid_thw=torch.tensor([layout.grid_thw])).pooler_output[0]
        assert got.shape == want.shape
        assert rel_diff(got, want) <= 1e-5


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_equal_the_full_processors_placeholder_count(adapters, model_type, layout):
    adapter, reference = adapters[model_type, layout], REFERENCE[f"{model_type}/{layout}"]
    for image, size, want in zip(sample_images(), IMAGE_SIZES, reference["images"], strict=True):
        assert want["size"] == list(size)
        got = adapter.item_layout("image", image)
        assert (got.tokens, list(got.grid_thw)) == (want["tokens"], want["grid_thw"]), size
    for clip, size, want in zip(sample_clips(), CLIP_SIZES, reference["videos"], strict=True):
        assert [want["frames"], *want["size"]] == list(size)
        got = adapter.item_layout("video", clip)
        assert (got.tokens, list(got.grid_thw)) == (want["tokens"], want["grid_thw"]), size


@pytest.mark.parametrize("layout", LAYOUTS)
def test_video_pixels_equal_transformers_video_processor(adapters, layout):
    """Bit for bit: same resize kernel, same fused normalisation, same patch order."""
    adapter, reference = adapters["glm4v", layout], REFERENCE[f"glm4v/{layout}"]
    assert reference["video_processor"] == "Glm4vVideoProcessor" == type(adapter.video.processor).__name__
    for clip, want in zip(sample_clips(), reference["videos"], strict=True):
        pixels, clip_layout = adapter.video.patches(clip)
        assert list(clip_layout.grid_thw) == want["grid_thw"]
        assert fingerprint(pixels) == want["pixels"]
