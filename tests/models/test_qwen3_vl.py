"""Qwen3-VL (dense, MoE) and Qwen3.5 from real checkpoint folders, against `transformers` itself.

1. Parity: an item's rows (deepstack blocks included) equal the model's own `get_image_features` /
   `get_video_features` for that item alone, within 1e-5 relative, also when items of different
   sizes are fused into one `preprocess` + `forward`.
2. The prefill side's count: an item's rows equal the number of placeholder tokens the family's
   full processor (`AutoProcessor.from_pretrained(folder)`) puts into `input_ids`; and a video's
   pixels equal those of `transformers`' own (torchvision) video processor. Both need torchvision,
   which this venv lacks, so they were computed by `tools/reference/processor_reference.py` on the same
   folders and media and committed in `tests/data/processor_reference.json`.
"""

from __future__ import annotations

import pytest

from encode_server.models.families.qwen3_vl import FAMILY
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.grid_vision import LAYOUTS, sample_clips
from tests.support.grid_vision_checks import (
    CPU,
    F32,
    REFERENCE,
    build_checkpoints,
    check_fused_images_equal_get_image_features_alone,
    check_fused_videos_equal_get_video_features_alone,
    check_rows_equal_the_full_processors_placeholder_count,
    check_video_pixels_equal_transformers_video_processor,
    load_adapters,
)

MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("qwen3"), MODEL_TYPES, first_seed=20)


@pytest.fixture(scope="module")
def adapters(checkpoints):
    return load_adapters(FAMILY, checkpoints)


def test_the_registry_serves_every_model_type_with_this_module():
    for model_type in MODEL_TYPES:
        assert family_for_model_type(model_type) is FAMILY


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_images_equal_get_image_features_alone(checkpoints, adapters, model_type):
    model, folders = checkpoints[model_type]
    adapter = adapters[model_type, "nested"]
    vision = model.config.vision_config
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    assert adapter.info.deepstack == deepstack and adapter.info.hidden_size == vision.out_hidden_size
    check_fused_images_equal_get_image_features_alone(model, folders["nested"], adapter)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_videos_equal_get_video_features_alone(checkpoints, adapters, model_type):
    check_fused_videos_equal_get_video_features_alone(checkpoints[model_type][0], adapters[model_type, "nested"])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_equal_the_full_processors_placeholder_count(adapters, model_type, layout):
    check_rows_equal_the_full_processors_placeholder_count(adapters[model_type, layout],
                                                           REFERENCE[f"{model_type}/{layout}"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_video_pixels_equal_transformers_video_processor(adapters, layout):
    """Bit for bit: same resize kernel, same fused normalisation, same patch order."""
    expected_class = "Qwen2VLVideoProcessor" if layout == "image_only" else "Qwen3VLVideoProcessor"
    check_video_pixels_equal_transformers_video_processor(adapters["qwen3_vl", layout],
                                                          REFERENCE[f"qwen3_vl/{layout}"], expected_class)


def test_one_frame_videos_and_wrong_items_are_item_errors(adapters):
    from processors.base import ItemError

    adapter = adapters["qwen3_vl", "nested"]
    with pytest.raises(ItemError, match="1 frames"):
        adapter.processor.item_layout("video", sample_clips()[0][:1])
    with pytest.raises(ItemError):
        adapter.processor.item_layout("video", [])
    with pytest.raises(ItemError):
        adapter.processor.item_layout("image", "not an image")


def test_a_video_processor_that_needs_torchvision_here_is_refused_at_load(checkpoints, tmp_path):
    import json as json_module
    import shutil

    from encode_server.models.loading.checkpoint import CheckpointError

    folder = tmp_path / "other-video-processor"
    shutil.copytree(checkpoints["qwen3_vl"][1]["separate"], folder)
    settings = json_module.loads((folder / "video_preprocessor_config.json").read_text())
    settings["video_processor_type"] = "LlavaOnevisionVideoProcessor"
    (folder / "video_preprocessor_config.json").write_text(json_module.dumps(settings))
    with pytest.raises(CheckpointError, match="LlavaOnevisionVideoProcessor is not supported without torchvision"):
        FAMILY.load(folder, CPU, F32)


def test_the_builtin_ships_deepstack_rows():
    from encode_server.models.registry import builtin_models

    adapter = builtin_models()["tiny-qwen3-vl"](CPU, F32)
    assert adapter.info.deepstack == 2 and adapter.info.row_width == 3 * adapter.info.hidden_size
    modality, item = adapter.processor.sample_item()
    rows = adapter.forward(adapter.processor.preprocess(modality, [item]))
    assert rows.shape == (adapter.processor.item_layout(modality, item).tokens, adapter.info.row_width)
