"""GLM-4.1V / 4.5V (`glm4v`, `glm4v_moe`) from real checkpoint folders, against `transformers` itself.

1. Parity: an item's rows equal the model's own `get_image_features` / `get_video_features` for
   that item alone, within 1e-5 relative, also when items of different sizes are fused into one
   `preprocess` + `forward` (a video's temporal groups reach the tower as separate items, as
   `get_video_features` flattens them).
2. The prefill side's count: an item's rows equal the number of image tokens the full
   `Glm4vProcessor` puts into `input_ids` for it (a video's frames are filled with image tokens);
   and a video's pixels equal those of `transformers`' own (torchvision) video processor. Both
   need torchvision, which this venv lacks, so they were computed by
   `tools/reference/processor_reference.py` on the same folders and media
   (`tests/data/processor_reference.json`).
"""

from __future__ import annotations

import pytest

from encode_server.models.families.glm4v import FAMILY
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.grid_vision import LAYOUTS
from tests.support.grid_vision_checks import (
    REFERENCE,
    build_checkpoints,
    check_fused_images_equal_get_image_features_alone,
    check_fused_videos_equal_get_video_features_alone,
    check_rows_equal_the_full_processors_placeholder_count,
    check_video_pixels_equal_transformers_video_processor,
    load_adapters,
)

pytestmark = pytest.mark.quick

MODEL_TYPES = ("glm4v", "glm4v_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("glm4v"), MODEL_TYPES, first_seed=30)


@pytest.fixture(scope="module")
def adapters(checkpoints):
    return load_adapters(FAMILY, checkpoints)


def test_the_registry_serves_glm4v_and_its_moe_twin():
    assert family_for_model_type("glm4v") is FAMILY and family_for_model_type("glm4v_moe") is FAMILY


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_images_equal_get_image_features_alone(checkpoints, adapters, model_type):
    model, folders = checkpoints[model_type]
    adapter = adapters[model_type, "nested"]
    assert adapter.info.deepstack == 0 and adapter.info.hidden_size == model.config.vision_config.out_hidden_size
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
    check_video_pixels_equal_transformers_video_processor(adapters["glm4v", layout],
                                                          REFERENCE[f"glm4v/{layout}"],
                                                          "Glm4vVideoProcessor")
