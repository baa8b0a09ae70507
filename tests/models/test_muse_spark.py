"""Muse Spark from a tiny full checkpoint, against `transformers` itself (images, videos, audio).

1. Parity: items of different sizes fused into one `preprocess` + `forward` give, sliced back, the rows the
   model's own `get_image_features` / `get_video_features` / `get_audio_features` give for each item alone.
2. The prefill side's count: in one prompt with an image, a video and an audio clip, the full processor
   (`AutoProcessor.from_pretrained(folder)`) inserts exactly as many placeholders as the rows, and the model's
   own forward splices exactly these rows there; the fields SGLang's language side reads (merged grids, clip
   timestamps, audio rows) rebuild the processor's expansion character for character.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from encode_server.models.families.muse_spark import FAMILY
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type, load_checkpoint
from processors.base import ItemError
from tests.support.checkpoints.muse_spark import MUSE_SAMPLING_RATE, muse_spark_checkpoint
from tests.support.family_fixtures import (
    check_fused_equals_alone,
    check_server_fuses_audio_and_serves_images_and_video,
    checkpoint_fixtures,
    spliced_rows,
)
from tests.support.helpers import rel_diff
from tests.support.tiny_parts import random_image, video, waveform

CPU, F32 = torch.device("cpu"), torch.float32
IMAGE_SIZES = [(60, 45), (130, 40), (30, 90), (300, 280)]  # the last is capped at max_image_tokens (16)
VIDEOS = [(60, 45, 3), (100, 50, 4), (40, 40, 1)]  # (width, height, frames): odd counts repeat the last frame
AUDIO_SECONDS = [0.5, 1.3, 0.01]  # 7, 17 and 1 rows (1920 samples a row at 24 kHz)
FPS = 2.0


checkpoint, adapter, processor = checkpoint_fixtures(
    lambda root: muse_spark_checkpoint(root / "muse_spark"), load_checkpoint)


def images():
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]


def videos():
    return [video(w, h, frames, seed) for seed, (w, h, frames) in enumerate(VIDEOS)]


def clips():
    return [waveform(seconds, MUSE_SAMPLING_RATE, seed) for seed, seconds in enumerate(AUDIO_SECONDS)]


def test_the_registry_serves_muse_spark_here(adapter):
    assert family_for_model_type("muse_spark") is FAMILY and FAMILY.shard is not None
    assert adapter.info.family == "muse_spark" and adapter.info.modalities == ("image", "video", "audio")
    assert adapter.processor.sampling_rate == MUSE_SAMPLING_RATE


def test_fused_images_equal_get_image_features_alone(checkpoint, adapter, processor):
    model = checkpoint[0]

    def alone(image):
        inputs = processor.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            return torch.cat(model.model.get_image_features(inputs["pixel_values"],
                                                            inputs["image_grid_thw"]).pooler_output)

    batch = check_fused_equals_alone(adapter, "image", images(), alone)
    assert [layout.receiver_grid for layout in batch.layouts] == [(1, 2, 3), (1, 1, 4), (1, 3, 1), (1, 4, 4)]
    assert [layout.grid_thw for layout in batch.layouts] == [(1, 4, 6), (1, 2, 8), (1, 6, 2), (1, 8, 8)]


def test_fused_videos_equal_get_video_features_alone(checkpoint, adapter, processor):
    model = checkpoint[0]

    def alone(frames):
        inputs = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        with torch.no_grad():
            return torch.cat(model.model.get_video_features(inputs["pixel_values_videos"],
                                                            inputs["video_grid_thw"]).pooler_output)

    batch = check_fused_equals_alone(adapter, "video", videos(), alone)
    assert [layout.grid_thw[0] for layout in batch.layouts] == [2, 2, 1]
    assert [layout.clip_frames for layout in batch.layouts] == [(0.0, 2.0), (0.0, 2.0), (0.0,)]


def test_fused_audio_equals_get_audio_features_alone(checkpoint, adapter, processor):
    model = checkpoint[0]

    def alone(wave):
        inputs = processor.feature_extractor([wave], sampling_rate=MUSE_SAMPLING_RATE, return_tensors="pt")
        with torch.no_grad():
            return model.model.get_audio_features(inputs["input_values"], inputs["input_values_mask"]).pooler_output

    batch = check_fused_equals_alone(adapter, "audio", clips(), alone)
    assert [layout.tokens for layout in batch.layouts] == [7, 17, 1]
    assert [layout.receiver_grid for layout in batch.layouts] == [7, 17, 1]
    # The preprocessing pool prepares each clip alone and collates them: the same padded batch.
    collated = adapter.processor.collate([adapter.processor.preprocess("audio", [wave]) for wave in clips()])
    assert all(torch.equal(collated.inputs[key], batch.inputs[key]) for key in batch.inputs)


def test_rows_fill_exactly_the_placeholders_the_full_processor_inserts(checkpoint, adapter, processor):
    from transformers.video_utils import VideoMetadata

    model = checkpoint[0]
    image, frames, wave = images()[0], videos()[1], clips()[1]
    metadata = VideoMetadata(total_num_frames=len(frames), fps=FPS, frames_indices=list(range(len(frames))))
    inputs = processor(text=["see <|patch|> then <|video|> and hear <|audio|>"], images=[image], videos=[frames],
                       audio=[wave], return_tensors="pt", sampling_rate=MUSE_SAMPLING_RATE,
                       videos_kwargs={"do_sample_frames": False, "return_metadata": True,
                                      "video_metadata": [metadata]})
    inputs.pop("video_metadata", None)
    config = model.config
    layouts = {"image": adapter.processor.item_layout("image", image),
               "video": adapter.processor.item_layout("video", frames),
               "audio": adapter.processor.item_layout("audio", wave)}
    token_ids = {"image": config.image_token_id, "video": config.video_token_id, "audio": config.audio_token_id}
    items = {"image": image, "video": frames, "audio": wave}
    for modality, token_id in token_ids.items():
        rows = adapter.forward(adapter.processor.preprocess(modality, [items[modality]]))
        placeholders = int((inputs["input_ids"] == token_id).sum())
        assert layouts[modality].tokens == placeholders == rows.shape[0]
        assert rel_diff(rows, spliced_rows(model, inputs, token_id)) <= 1e-5

    # What SGLang's Muse processor rebuilds from the receiver's fields is what this processor inserted.
    text = processor.tokenizer.decode(inputs["input_ids"][0])
    t, ph, pw = layouts["image"].receiver_grid
    expected_image = "<|image_start|>" + "<|patch|>" * (t * ph * pw) + "<|image_end|>"
    clips_, vh, vw = layouts["video"].receiver_grid
    stamps = [frame / FPS for frame in layouts["video"].clip_frames]
    assert len(stamps) == clips_
    pieces = [processor.video_processor.frame_timestamp_format.format(timestamp=s) + "<|video|>" * (vh * vw)
              for s in stamps]
    expected_video = "<|vid_start|>" + "<|vid_frame_separator|>".join(pieces) + "<|vid_end|>"
    expected_audio = "<|soft_audio_start|>" + "<|audio|>" * layouts["audio"].receiver_grid + "<|soft_audio_end|>"
    assert text == f"see {expected_image} then {expected_video} and hear {expected_audio}"
    assert "Time: 1.0s" in expected_video


@pytest.mark.parametrize("modality,item,message", [
    ("audio", np.zeros(0, dtype=np.float32), "0 samples"),
    ("audio", np.zeros((2, 100), dtype=np.float32), "mono"),
    ("video", [random_image(40, 40, 0), random_image(42, 40, 1)], "one size"),
    ("video", [], "non-empty list"),
    ("image", np.zeros(10, dtype=np.float32), "expected an image"),
])
def test_items_the_model_cannot_take_are_refused_by_name(adapter, modality, item, message):
    with pytest.raises(ItemError, match=message):
        adapter.processor.item_layout(modality, item)


def test_a_processor_that_disagrees_with_the_tower_is_refused(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint[1], broken)
    settings = json.loads((broken / "processor_config.json").read_text())
    settings["image_processor"]["merge_size"] = 1
    (broken / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=r"image processor's \(patch, merge, temporal patch\) \(14, 1, 2\)"):
        FAMILY.load(broken, CPU, F32)


def test_the_server_fuses_audio_requests_and_serves_images_and_video(checkpoint, adapter, processor):
    """Through the real server: four audio requests in one forward, each answered with its clip's own rows."""
    model, folder = checkpoint

    def alone(wave):
        inputs = processor.feature_extractor([wave], sampling_rate=MUSE_SAMPLING_RATE, return_tensors="pt")
        with torch.no_grad():
            return model.model.get_audio_features(inputs["input_values"], inputs["input_values_mask"]).pooler_output

    waves = [waveform(seconds, MUSE_SAMPLING_RATE, seed) for seed, seconds in enumerate([0.3, 1.1, 0.7, 2.0])]
    check_server_fuses_audio_and_serves_images_and_video(folder, "muse_spark", MUSE_SAMPLING_RATE, waves, alone,
                                                         [4, 14, 9, 25], adapter, images()[0], videos()[0])


def test_without_torchvision_the_folder_is_refused_naming_it(checkpoint, monkeypatch):
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    with pytest.raises(CheckpointError, match="muse_spark: its image and video processors need torchvision"):
        FAMILY.load(checkpoint[1], CPU, F32)
