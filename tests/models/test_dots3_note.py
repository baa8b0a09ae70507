"""Dots3-Note from a tiny full checkpoint in the published layout, against `transformers` itself (images, videos,
audio).

1. Loading: `save_pretrained` writes the published layout (`vision_encoder.*` with every vision expert's
   `fc1`/`fc2`/`fc3` apart, `audio_encoder.dots_encoder.speech_encoder.*`); the towers load from it through
   `transformers`' own renamings and expert-stacking converters to exactly the tensors `from_pretrained` makes.
2. Parity: items of different sizes fused into one `preprocess` + `forward` give, sliced back, the rows the
   model's own `get_image_features` / `get_video_features` / `get_audio_features` give for each item alone
   (audio longer than one chunk included).
3. The prefill side's count: the full processor inserts exactly as many placeholders as the rows, and the
   model's own forward splices exactly these rows there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from encode_server.models.families.dots3_note import FAMILY
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type, load_checkpoint
from processors.base import ItemError
from processors.families.dots3_note import audio_rows
from tests.support.checkpoints.dots3_note import DOTS_SAMPLING_RATE, dots3_note_checkpoint
from tests.support.family_fixtures import (
    check_fused_equals_alone,
    check_server_fuses_audio_and_serves_images_and_video,
    checkpoint_fixtures,
    spliced_rows,
)
from tests.support.helpers import rel_diff
from tests.support.tiny_parts import random_image, video, waveform

CPU, F32 = torch.device("cpu"), torch.float32
IMAGE_SIZES = [(60, 45), (130, 40), (30, 90), (100, 100)]
VIDEOS = [(60, 45, 3), (100, 50, 2)]  # (width, height, frames): one frame per temporal patch
AUDIO_SECONDS = [0.5, 7.3, 0.01]  # 7.3 s is three chunks of at most 3 s: 38 + 38 + 17 rows


checkpoint, adapter, processor = checkpoint_fixtures(
    lambda root: dots3_note_checkpoint(root / "dots3_note"), load_checkpoint)


def images():
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]


def videos():
    return [video(w, h, frames, seed) for seed, (w, h, frames) in enumerate(VIDEOS)]


def clips():
    return [waveform(seconds, DOTS_SAMPLING_RATE, seed) for seed, seconds in enumerate(AUDIO_SECONDS)]


def test_the_registry_serves_dots3_note_here_without_a_tensor_parallel_plan(adapter):
    assert family_for_model_type("dots3_note") is FAMILY and FAMILY.shard is None
    assert adapter.info.family == "dots3_note" and adapter.info.modalities == ("image", "video", "audio")
    assert adapter.processor.sampling_rate == DOTS_SAMPLING_RATE


def test_the_published_layout_loads_to_the_tensors_from_pretrained_makes(checkpoint, adapter):
    from safetensors import safe_open

    model, folder = checkpoint
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert {"vision_encoder.blocks.1.mlp.experts.3.fc3.weight", "vision_encoder.post_trunk_norm.weight"} <= keys
    assert "audio_encoder.dots_encoder.speech_encoder.layers.0.self_attn.out_proj.weight" in keys
    assert not any(key.startswith("model.vision_tower") for key in keys)
    for ours, theirs in ((adapter.encoder["visual"], model.model.vision_tower),
                         (adapter.encoder["audio"], model.model.audio_tower)):
        expected = theirs.state_dict()
        loaded = ours.state_dict()
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[key], expected[key]) for key in expected)
    assert adapter.encoder["visual"].blocks[1].mlp.experts.gate_up_proj.shape[0] == 4  # the 4 experts stacked


def test_fused_images_equal_get_image_features_alone(checkpoint, adapter, processor):
    model = checkpoint[0]

    def alone(image):
        inputs = processor.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            return torch.cat(model.model.get_image_features(inputs["pixel_values"],
                                                            inputs["image_grid_thw"]).pooler_output)

    batch = check_fused_equals_alone(adapter, "image", images(), alone)
    assert [layout.grid_thw for layout in batch.layouts] == [(1, 4, 4), (1, 2, 10), (1, 6, 2), (1, 6, 6)]


def test_fused_videos_equal_get_video_features_alone(checkpoint, adapter, processor):
    model = checkpoint[0]

    def alone(frames):
        inputs = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        assert torch.equal(inputs["pixel_values_videos"], adapter.processor.preprocess("video",
                                                                                       [frames]).inputs["pixel_values"])
        with torch.no_grad():
            return torch.cat(model.model.get_video_features(inputs["pixel_values_videos"],
                                                            inputs["video_grid_thw"]).pooler_output)

    batch = check_fused_equals_alone(adapter, "video", videos(), alone)
    assert [layout.grid_thw[0] for layout in batch.layouts] == [3, 2]


def test_fused_audio_equals_get_audio_features_alone(checkpoint, adapter, processor):
    model = checkpoint[0]

    def alone(wave):
        inputs = processor.feature_extractor([wave], sampling_rate=DOTS_SAMPLING_RATE, return_tensors="pt")
        with torch.no_grad():
            return model.model.get_audio_features(inputs["input_features"],
                                                  inputs["chunk_sample_lengths"]).pooler_output

    batch = check_fused_equals_alone(adapter, "audio", clips(), alone)
    assert [layout.tokens for layout in batch.layouts] == [7, 93, 1]
    assert [layout.receiver_grid for layout in batch.layouts] == [7, 93, 1]
    # The preprocessing pool prepares each clip alone and collates them (chunks padded to the longest).
    collated = adapter.processor.collate([adapter.processor.preprocess("audio", [wave]) for wave in clips()])
    assert rel_diff(adapter.forward(collated), adapter.forward(batch)) <= 1e-6


def test_audio_rows_sum_over_chunks():
    chunk, row = 48000, 1280
    assert audio_rows(1, chunk, row) == 1 and audio_rows(1280, chunk, row) == 1 and audio_rows(1281, chunk, row) == 2
    assert audio_rows(48000, chunk, row) == 38  # ceil(37.5): one chunk
    assert audio_rows(48001, chunk, row) == 39  # a second chunk of one sample
    assert audio_rows(960000, 960000, row) == 750  # the published 60 s chunk holds exactly 750 rows


def test_rows_fill_exactly_the_placeholders_the_full_processor_inserts(checkpoint, adapter, processor):
    model = checkpoint[0]
    image, frames, wave = images()[1], videos()[0], clips()[1]
    inputs = processor(text=["see <|imgpad|> then <|video_pad|> and hear <|audio_comp_pad|>"], images=[image],
                       videos=[frames], audio=[wave], return_tensors="pt", sampling_rate=DOTS_SAMPLING_RATE,
                       videos_kwargs={"do_sample_frames": False})
    config = model.config
    token_ids = {"image": config.image_token_id, "video": config.video_token_id, "audio": config.audio_token_id}
    items = {"image": image, "video": frames, "audio": wave}
    for modality, token_id in token_ids.items():
        layout = adapter.processor.item_layout(modality, items[modality])
        rows = adapter.forward(adapter.processor.preprocess(modality, [items[modality]]))
        placeholders = int((inputs["input_ids"] == token_id).sum())
        assert layout.tokens == placeholders == rows.shape[0]
        assert rel_diff(rows, spliced_rows(model, inputs, token_id)) <= 1e-5


@pytest.mark.parametrize("modality,item,message", [
    ("audio", np.zeros(0, dtype=np.float32), "0 samples"),
    ("audio", np.zeros((2, 100), dtype=np.float32), "mono"),
    ("video", [], "non-empty list"),
    ("image", np.zeros(10, dtype=np.float32), "expected an image"),
])
def test_items_the_model_cannot_take_are_refused_by_name(adapter, modality, item, message):
    with pytest.raises(ItemError, match=message):
        adapter.processor.item_layout(modality, item)


def test_an_image_processor_with_temporal_patches_is_refused(checkpoint, tmp_path):
    """The tower embeds one frame per patch; a processor that stacks two would feed it twice the patches."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint[1], broken)
    settings = json.loads((broken / "processor_config.json").read_text())
    settings["image_processor"]["temporal_patch_size"] = 2
    (broken / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match="temporal patch 2.*temporal patch 1"):
        FAMILY.load(broken, CPU, F32)


def test_the_server_fuses_audio_requests_and_serves_images_and_video(checkpoint, adapter, processor):
    """Through the real server: four audio requests in one forward, each answered with its clip's own rows."""
    model, folder = checkpoint

    def alone(wave):
        inputs = processor.feature_extractor([wave], sampling_rate=DOTS_SAMPLING_RATE, return_tensors="pt")
        with torch.no_grad():
            return model.model.get_audio_features(inputs["input_features"],
                                                  inputs["chunk_sample_lengths"]).pooler_output

    waves = [waveform(seconds, DOTS_SAMPLING_RATE, seed) for seed, seconds in enumerate([0.3, 4.0, 0.7, 2.0])]
    check_server_fuses_audio_and_serves_images_and_video(folder, "dots3_note", DOTS_SAMPLING_RATE, waves, alone,
                                                         [4, 51, 9, 25], adapter, images()[0], videos()[0])


def test_from_the_hub_only_the_towers_bytes_are_read_experts_included(checkpoint, shared_hub):
    """Through the Hub stand-in: the encoder-only folder holds every tower tensor (each expert's weights apart, as
    published) and no language-model tensor, and gives the local folder's rows bit for bit."""
    from tests.support.helpers import run_python_module
    from tests.support.hub_stand_in import expected_bytes, header_of, hub_env

    folder = checkpoint[1]
    hub, home = shared_hub
    hub.add({"org/dots3": folder}).reset_counts()
    result = run_python_module("tests.support.hub_family_check", json.dumps({"org/dots3": str(folder)}),
                               env=hub_env(hub, home), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.splitlines()[-1])["org/dots3"]
    assert outcome["equal"] and outcome["family"] == "dots3_note", outcome
    fetched = set(header_of(Path(outcome["folder"]) / "model.safetensors")[1])
    assert "vision_encoder.blocks.1.mlp.experts.3.fc1.weight" in fetched
    assert not any(key.startswith(("model.", "lm_head")) for key in fetched)
    assert all(key.startswith(("vision_encoder.", "audio_encoder.")) for key in fetched)
    for name, size in expected_bytes(folder, fetched).items():
        assert hub.served[("org/dots3", name)] == size, name
