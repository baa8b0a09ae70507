"""MiniMax-M3 VL (`minimax_m3_vl`) from a tiny full checkpoint in the published key layout, against
`transformers` itself (its processors need torchvision).

1. Loading: the folder holds the tower as `vision_tower.vision_model.*` and the merge MLP as
   `patch_merge_mlp.*` (what `save_pretrained` writes); they load as the model's own weights.
2. Parity: images of five sizes, and clips of 1 to 8 frames (cut into attention segments of 2 temporal patches
   by the processor) fused into one forward give each exactly `get_image_features` / `get_video_features` alone.
3. The prefill side's count: the full `MiniMaxM3VLProcessor` inserts as many placeholders as the item's rows,
   and the model's forward splices exactly our rows there. It does not resize videos (its callers do), so
   its clips here are whole merged patches within the budget, which the video processor's own resize (ours)
   leaves as they are: our pixels are the full processor's, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from encode_server.models.families.minimax_m3_vl import FAMILY
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.media import PROMPTS, sample_clips, sample_images
from tests.support.checkpoints.minimax_m3_vl import minimax_m3_vl_checkpoint
from tests.support.family_fixtures import checkpoint_fixtures
from tests.support.tiny_parts import clip
from tests.support.torchvision_family_checks import check_fused, check_prompt_rows

pytestmark = pytest.mark.quick

pytest.importorskip("torchvision", reason="MiniMax-M3's transformers processors need torchvision")

CPU, F32 = torch.device("cpu"), torch.float32
#: (frames, width, height): whole 28-pixel merged patches within the tiny video processor's pixel budget.
ALIGNED_CLIPS = [(3, 56, 84), (5, 112, 56), (4, 84, 84)]


checkpoint, adapter, processor = checkpoint_fixtures(
    lambda root: minimax_m3_vl_checkpoint(root / "tiny-minimax-m3-vl"), FAMILY.load)


def aligned_clips():
    return [clip(n, w, h, 90 + seed) for seed, (n, w, h) in enumerate(ALIGNED_CLIPS)]


def test_the_registry_serves_minimax_m3_vl_with_a_tensor_parallel_plan():
    assert family_for_model_type("minimax_m3_vl") is FAMILY and FAMILY.shard is not None


def test_published_key_layout_loads_as_the_models_own_weights(checkpoint, adapter):
    model, folder = checkpoint
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert any(key.startswith("vision_tower.vision_model.encoder.layers.") for key in keys)
    assert any(key.startswith("patch_merge_mlp.") for key in keys)
    ours, theirs = adapter.model.state_dict(), model.model.state_dict()
    assert all(torch.equal(tensor, theirs[key]) for key, tensor in ours.items())
    assert adapter.packed_attention and adapter.info.modalities == ("image", "video")


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
            parts = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
        return torch.cat(parts.pooler_output)  # one part per attention segment

    clips = sample_clips()
    check_fused(adapter, "video", clips, reference)
    assert [adapter.processor.item_layout("video", clip).grid_thw[0] for clip in clips] == [1, 2, 3, 4]
    segments = adapter.processor.preprocess("video", clips).inputs["grid_thw"][:, 0].tolist()
    assert segments == [1, 2, 2, 1, 2, 2]  # vision_segment_max_frames = 2 temporal patches


def test_rows_fill_the_image_placeholders_and_are_spliced_there(checkpoint, adapter, processor):
    check_prompt_rows(adapter, processor, "image", sample_images(), PROMPTS["minimax_m3_vl"]["image"],
                      PROMPTS["minimax_m3_vl"]["image_token"], checkpoint[0])


def test_rows_fill_the_video_placeholders_and_are_spliced_there(checkpoint, adapter, processor):
    check_prompt_rows(adapter, processor, "video", aligned_clips(), PROMPTS["minimax_m3_vl"]["video"],
                      PROMPTS["minimax_m3_vl"]["video_row_token"], checkpoint[0])


def test_aligned_frames_give_the_full_processors_pixels(adapter, processor):
    for frames in aligned_clips():
        theirs = processor(text=[PROMPTS["minimax_m3_vl"]["video"]], videos=[frames], do_sample_frames=False,
                           return_tensors="pt")
        ours = adapter.processor.preprocess("video", [frames]).inputs
        assert torch.equal(ours["pixel_values"], theirs["pixel_values_videos"])
        assert torch.equal(ours["grid_thw"], theirs["video_grid_thw"])
