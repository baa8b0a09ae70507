"""Qwen3-VL (dense, MoE) and Qwen3.5 from real checkpoint folders, against `transformers` itself.

1. Parity: an item's rows (deepstack blocks included) equal the model's own `get_image_features` /
   `get_video_features` for that item alone, within 1e-5 relative, also when items of different
   sizes are fused into one `preprocess` + `forward`.
2. The prefill side's count: an item's rows equal the number of placeholder tokens the family's
   full processor (`AutoProcessor.from_pretrained(folder)`) puts into `input_ids`; and a video's
   pixels equal those of `transformers`' own (torchvision) video processor. Both need torchvision,
   which this venv lacks, so they were computed by `scripts/processor_reference.py` on the same
   folders and media and committed in `tests/data/processor_reference.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from processors.qwen3_vl import FAMILY
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
MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
REFERENCE = json.loads((Path(__file__).parent / "data" / "processor_reference.json").read_text())["folders"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {model_type: checkpoint_folders(root, model_type, seed=20 + index)
            for index, model_type in enumerate(MODEL_TYPES)}


@pytest.fixture(scope="module")
def adapters(checkpoints):
    return {(model_type, layout): FAMILY.load(folder, CPU, F32)
            for model_type, (_, folders) in checkpoints.items() for layout, folder in folders.items()}


def expected_rows(features) -> list[torch.Tensor]:
    """Per item: the main rows and the deepstack blocks side by side, as the family ships them."""
    deepstack = getattr(features, "deepstack_features", None) or []
    return [torch.cat([main, *(layer[index] for layer in deepstack)], dim=-1)
            for index, main in enumerate(features.pooler_output)]


def test_the_registry_serves_every_model_type_with_this_module():
    for model_type in MODEL_TYPES:
        assert family_for_model_type(model_type) is FAMILY


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_images_equal_get_image_features_alone(checkpoints, adapters, model_type):
    from transformers import AutoImageProcessor

    model, folders = checkpoints[model_type]
    adapter = adapters[model_type, "nested"]
    processor = AutoImageProcessor.from_pretrained(folders["nested"])
    vision = model.config.vision_config
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    assert adapter.info.deepstack == deepstack and adapter.info.hidden_size == vision.out_hidden_size
    images = sample_images()
    batch = adapter.preprocess("image", images)
    pieces = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
    for image, got in zip(images, pieces, strict=True):
        inputs = processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                      image_grid_thw=inputs["image_grid_thw"])
        want = expected_rows(features)[0]
        assert got.shape == (want.shape[0], adapter.info.row_width) == want.shape
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
            features = model.model.get_video_features(pixel_values_videos=pixels,
                                                      video_grid_thw=torch.tensor([layout.grid_thw]))
        assert rel_diff(got, expected_rows(features)[0]) <= 1e-5


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
    adapter, reference = adapters["qwen3_vl", layout], REFERENCE[f"qwen3_vl/{layout}"]
    expected_class = "Qwen2VLVideoProcessor" if layout == "image_only" else "Qwen3VLVideoProcessor"
    assert reference["video_processor"] == expected_class == type(adapter.video.processor).__name__
    for clip, want in zip(sample_clips(), reference["videos"], strict=True):
        pixels, clip_layout = adapter.video.patches(clip)
        assert list(clip_layout.grid_thw) == want["grid_thw"]
        assert fingerprint(pixels) == want["pixels"]


def test_one_frame_videos_and_wrong_items_are_item_errors(adapters):
    from processors.base import ItemError

    adapter = adapters["qwen3_vl", "nested"]
    with pytest.raises(ItemError, match="1 frames"):
        adapter.item_layout("video", sample_clips()[0][:1])
    with pytest.raises(ItemError):
        adapter.item_layout("video", [])
    with pytest.raises(ItemError):
        adapter.item_layout("image", "not an image")


def test_a_video_processor_that_needs_torchvision_here_is_refused_at_load(checkpoints, tmp_path):
    import json as json_module
    import shutil

    from processors.checkpoint import CheckpointError

    folder = tmp_path / "other-video-processor"
    shutil.copytree(checkpoints["qwen3_vl"][1]["separate"], folder)
    settings = json_module.loads((folder / "video_preprocessor_config.json").read_text())
    settings["video_processor_type"] = "LlavaOnevisionVideoProcessor"
    (folder / "video_preprocessor_config.json").write_text(json_module.dumps(settings))
    with pytest.raises(CheckpointError, match="LlavaOnevisionVideoProcessor is not supported without torchvision"):
        FAMILY.load(folder, CPU, F32)


def test_the_builtin_ships_deepstack_rows():
    from processors.registry import builtin_models

    adapter = builtin_models()["tiny-qwen3-vl"](CPU, F32)
    assert adapter.info.deepstack == 2 and adapter.info.row_width == 3 * adapter.info.hidden_size
    modality, item = adapter.sample_item()
    rows = adapter.forward(adapter.preprocess(modality, [item]))
    assert rows.shape == (adapter.item_layout(modality, item).tokens, adapter.info.row_width)
