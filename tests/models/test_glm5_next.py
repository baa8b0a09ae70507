"""GLM-5-Next (`glm5_next`) from a tiny full checkpoint, against `transformers` itself (its processors need
torchvision).

1. Parity: images of five sizes, and clips of 1 to 8 frames of four sizes, each fused into one forward, give
   every item exactly what `Glm5NextModel.get_image_features` / `get_video_features` give for it alone.
2. The prefill side's count: the full `Glm5NextProcessor` inserts as many image tokens for an item (a video's
   frames are filled with image tokens) as the item has rows, and the model's forward splices our rows there.
3. Start-up: a folder whose processors cannot run here is refused naming torchvision.
"""

from __future__ import annotations

import pytest
import torch

from encode_server.models.families.glm5_next import FAMILY
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.glm5_next import glm5_next_checkpoint
from tests.support.checkpoints.media import PROMPTS, sample_clips, sample_images
from tests.support.family_fixtures import checkpoint_fixtures
from tests.support.torchvision_family_checks import check_fused, check_prompt_rows

pytest.importorskip("torchvision", reason="GLM-5-Next's transformers processors need torchvision")

CPU, F32 = torch.device("cpu"), torch.float32


checkpoint, adapter, processor = checkpoint_fixtures(
    lambda root: glm5_next_checkpoint(root / "tiny-glm5-next"), FAMILY.load)


def test_the_registry_serves_glm5_next_with_a_tensor_parallel_plan():
    assert family_for_model_type("glm5_next") is FAMILY and FAMILY.shard is not None


def test_the_tower_takes_the_fast_paths_of_the_grid_families(checkpoint, adapter):
    model, _ = checkpoint
    assert adapter.info.modalities == ("image", "video") and adapter.info.deepstack == 0
    assert adapter.info.hidden_size == model.config.vision_config.out_hidden_size
    assert adapter.embeds_parts and adapter.packed_attention


def test_fused_images_equal_get_image_features_alone(checkpoint, adapter, processor):
    model, _ = checkpoint

    def reference(image):
        inputs = processor.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            return model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]

    check_fused(adapter, "image", sample_images(), reference)


def test_fused_videos_equal_get_video_features_alone(checkpoint, adapter, processor):
    model, _ = checkpoint

    def reference(frames):
        inputs = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        with torch.no_grad():
            return model.model.get_video_features(inputs["pixel_values_videos"],
                                                  inputs["video_grid_thw"]).pooler_output[0]

    clips = sample_clips()
    check_fused(adapter, "video", clips, reference)
    assert [adapter.processor.item_layout("video", clip).grid_thw[0] for clip in clips] == [1, 2, 3,
                                                                                            4]  # frames / 2, up


@pytest.mark.parametrize("modality", ["image", "video"])
def test_rows_fill_the_placeholders_of_the_full_processor(checkpoint, adapter, processor, modality):
    model, _ = checkpoint
    items = sample_images() if modality == "image" else sample_clips()
    check_prompt_rows(adapter, processor, modality, items, PROMPTS["glm5_next"][modality],
                      PROMPTS["glm5_next"]["video_row_token" if modality == "video" else "image_token"], model)


def test_a_folder_is_refused_naming_torchvision_where_it_is_missing(checkpoint, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    with pytest.raises(CheckpointError, match="need torchvision"):
        FAMILY.load(checkpoint[1], CPU, F32)
