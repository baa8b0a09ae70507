"""Kimi K2.5 (`kimi_k25`) from a tiny full checkpoint in the published key layout, against `transformers` itself
(its processors need torchvision).

1. Loading: the folder holds the tower as fused, rope-permuted `wqkv` rows (what `save_pretrained` writes);
   the family loads them through `transformers`' own conversion into exactly the model's q, k, v weights,
   reading only the encoder's shards.
2. Parity: images of five sizes fused into one forward give each exactly `get_image_features` alone. Clips of
   1 to 8 frames (chunks of 4 frames, short last chunks included) fused into one batch give each what the
   model's tower and projector give it alone; the reference pools frames with the tower's own
   `temporal_patch_merger`, because `get_video_features` itself miscounts pooled chunks in transformers 5.23
   (pinned below).
3. The prefill side's count: the full `Kimi_K25Processor` inserts as many placeholders as the item's rows
   (an image's are spliced with exactly our rows by the model's forward).
"""

from __future__ import annotations

import json

import pytest
import torch

from encode_server.models.families.kimi_k25 import FAMILY
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.kimi_k25 import kimi_k25_checkpoint
from tests.support.checkpoints.media import PROMPTS, sample_clips, sample_images
from tests.support.family_fixtures import checkpoint_fixtures
from tests.support.torchvision_family_checks import check_fused, check_prompt_rows

pytest.importorskip("torchvision", reason="Kimi K2.5's transformers processors need torchvision")

CPU, F32 = torch.device("cpu"), torch.float32


checkpoint, adapter, processor = checkpoint_fixtures(
    lambda root: kimi_k25_checkpoint(root / "tiny-kimi-k25"), FAMILY.load)


def video_reference(model, processor, frames) -> torch.Tensor:
    """The model's rows for one clip alone: its `get_video_features`, or in transformers 5.23 (whose
    `get_video_features` miscounts pooled chunks: see below) the tower, its `temporal_patch_merger` (the per-chunk
    pooling loop that version keeps beside its gather) and the projector."""
    inputs = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    tower = model.model.vision_tower
    with torch.no_grad():
        if not hasattr(tower, "temporal_patch_merger"):
            return torch.cat(model.model.get_video_features(pixels, grid).pooler_output)
        sizes = grid.prod(-1).tolist()
        hidden = torch.cat([tower(chunk, grid_thw=grid[index:index + 1]).last_hidden_state
                            for index, chunk in enumerate(torch.split(pixels, sizes))])
        return model.model.mm_projector(tower.temporal_patch_merger(hidden, grid)).squeeze(1)


def test_the_registry_serves_kimi_k25_with_a_tensor_parallel_plan():
    assert family_for_model_type("kimi_k25") is FAMILY and FAMILY.shard is not None


def test_fused_wqkv_rows_load_as_the_models_own_q_k_v(checkpoint, adapter):
    model, folder = checkpoint
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in keys and not any("q_proj" in key for key in keys)
    ours, theirs = adapter.model.state_dict(), model.model.state_dict()
    assert "vision_tower.layers.0.attn.q_proj.weight" in ours
    assert all(torch.equal(tensor, theirs[key]) for key, tensor in ours.items())
    assert adapter.packed_attention and adapter.info.modalities == ("image", "video")


def test_only_the_encoders_shards_are_read(checkpoint, tmp_path):
    """Shards holding nothing of the encoder are never opened (here they do not even exist)."""
    model, _ = checkpoint
    folder = kimi_k25_checkpoint(tmp_path / "sharded", max_shard_size="40KB")[1]
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    encoder = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
    needed = {shard for key, shard in weight_map.items() if key.startswith(encoder)}
    unneeded = set(weight_map.values()) - needed
    assert unneeded, "the language model should have shards of its own"
    for shard in unneeded:
        (folder / shard).unlink()
    image = sample_images()[2]
    rows = [FAMILY.load(path, CPU, F32) for path in (folder, checkpoint[1])]
    assert torch.equal(*[adapter.forward(adapter.processor.preprocess("image", [image])) for adapter in rows])


def test_the_layout_transformers_holds_in_memory_loads_too(checkpoint, adapter, tmp_path):
    """Keys already unfused (`model.vision_tower.layers.N.attn.q_proj`, as a plain `state_dict` dump holds them)
    load as they are: no conversion applies twice (and a file with the encoder's tensors alone is enough)."""
    import shutil

    from safetensors.torch import save_file

    model, folder = checkpoint
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    save_file({key: tensor.contiguous() for key, tensor in model.state_dict().items()
               if key.startswith(("model.vision_tower.", "model.mm_projector."))},  # the encoder's tensors only
              str(plain / "model.safetensors"), metadata={"format": "pt"})
    image = sample_images()[3]
    rows = [loaded.forward(loaded.processor.preprocess("image", [image])) for loaded in (FAMILY.load(plain, CPU,
                                                                                                     F32), adapter)]
    assert torch.equal(*rows)

def test_fused_images_equal_get_image_features_alone(checkpoint, adapter, processor):
    model, _ = checkpoint

    def reference(image):
        inputs = processor.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            return model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]

    check_fused(adapter, "image", sample_images(), reference)


def test_fused_videos_equal_the_model_on_each_clip_alone(checkpoint, adapter, processor):
    model, _ = checkpoint
    clips = sample_clips()
    check_fused(adapter, "video", clips, lambda frames: video_reference(model, processor, frames))
    # 1, 3, 5 and 8 frames: 1, 1, 2 and 2 chunks of up to 4 frames, the 5-frame clip's last one a single frame
    assert [adapter.processor.item_layout("video", clip).grid_thw[0] for clip in clips] == [1, 1, 2, 2]


def test_transformers_get_video_features_miscounts_pooled_chunks_or_gives_the_adapters_rows(checkpoint, adapter,
                                                                                          processor):
    """In transformers 5.23 `get_image_features` splits the pooled rows by `t*h*w/4` per chunk, where pooling left
    `h*w/4` (so the video reference above is built from the tower's parts there); from 5.24 it splits them right,
    and its rows must be the adapter's."""
    model, _ = checkpoint
    clip = sample_clips()[1]
    inputs = processor.video_processor(videos=[clip], do_sample_frames=False, return_tensors="pt")
    assert inputs["video_grid_thw"].tolist() == [[3, 6, 8]]
    try:
        with torch.no_grad():
            features = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    except RuntimeError as exc:
        assert "split_with_sizes" in str(exc) and hasattr(model.model.vision_tower, "temporal_patch_merger")
        return
    ours = adapter.forward(adapter.processor.preprocess("video", [clip]))
    torch.testing.assert_close(ours, torch.cat(features.pooler_output), rtol=1e-5, atol=1e-5)


def test_rows_fill_the_image_placeholders_and_are_spliced_there(checkpoint, adapter, processor):
    check_prompt_rows(adapter, processor, "image", sample_images(), PROMPTS["kimi_k25"]["image"],
                      PROMPTS["kimi_k25"]["image_token"], checkpoint[0])


def test_rows_fill_the_video_placeholders(adapter, processor):
    """One frame's rows per chunk, as `Kimi_K25Processor.replace_video_token` counts them."""
    check_prompt_rows(adapter, processor, "video", sample_clips(), PROMPTS["kimi_k25"]["video"],
                      PROMPTS["kimi_k25"]["video_row_token"])

