"""Videos give the rows the model's language model receives from `transformers` in this environment.

- Qwen2-VL and Qwen2.5-VL, from tiny full checkpoints saved with their full processor: the folder's
  `AutoProcessor` (its torchvision video processor, as a monolithic server runs it) inserts as many
  placeholders as our rows, and the model's own forward splices exactly our rows there, for each clip
  alone and for clips fused in one forward.
- `VideoPatcher` (the one video path of the Qwen-grid families: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5,
  GLM-4V, GLM-5-Next, the Omni thinkers, Dots3-Note) equals, value for value, each torchvision video
  processor class it stands in for, on clips that are shrunk, enlarged, capped and padded; and it gives
  the same values with torchvision hidden (a machine without it), so both environments get these rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.models.registry import load_checkpoint
from processors.base import ItemError
from processors.video_patches import CLIP_SIZING, VideoPatcher, qwen2_vl_video_settings_class
from tests.support.checkpoints.qwen_vl import QWEN_VL_TOKENS, qwen2_vl_checkpoint, qwen25_vl_checkpoint
from tests.support.helpers import ROOT, WITHOUT_TORCHVISION
from tests.support.tiny_parts import tiny_tokenizer
from tests.support.torchvision_family_checks import check_fused, check_prompt_rows, spliced_rows

CPU, F32 = torch.device("cpu"), torch.float32
CHECKPOINTS = {"qwen2_vl": qwen2_vl_checkpoint, "qwen2_5_vl": qwen25_vl_checkpoint}
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}
PROMPT = "describe <|vision_start|><|video_pad|><|vision_end|>"

#: Clips as (frames, width, height): odd frame counts (the last frame repeated), sizes that are not multiples
#: of 28 (resized down and up), one already on the grid (not resized).
CLIPS = [(5, 70, 50), (2, 100, 60), (3, 64, 48), (4, 30, 200), (2, 56, 84)]


def frames_of(frames: int, width: int, height: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed + 1000 * frames + width + height)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(frames)]


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def full(request, tmp_path_factory):
    """(model, the folder's AutoProcessor, our adapter) for a checkpoint saved with its full processor."""
    import transformers
    from transformers import AutoProcessor, AutoVideoProcessor

    model, image_processor, folder = CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))
    video_processor = AutoVideoProcessor.from_pretrained(folder)
    assert type(video_processor).__name__ == "Qwen2VLVideoProcessor"  # torchvision's, as transformers picks it
    tokenizer = tiny_tokenizer(plain=QWEN_VL_TOKENS)
    getattr(transformers, PROCESSORS[request.param])(image_processor=image_processor, tokenizer=tokenizer,
                                                     video_processor=video_processor).save_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    model.config.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    model.config.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return model, processor, load_checkpoint(folder, CPU, F32)


def test_each_clip_gets_the_rows_the_model_splices_from_its_own_processor(full):
    model, processor, adapter = full
    check_prompt_rows(adapter, processor, "video", [frames_of(*clip) for clip in CLIPS], PROMPT, "<|video_pad|>",
                      model)


def test_fused_clips_each_get_the_rows_the_model_splices_alone(full):
    model, processor, adapter = full
    token_id = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")

    def reference(frames):
        inputs = processor(text=[PROMPT], videos=[frames], do_sample_frames=False, return_tensors="pt")
        return spliced_rows(model, inputs, inputs["input_ids"] == token_id)

    check_fused(adapter, "video", [frames_of(*clip, seed=7) for clip in CLIPS], reference)


def test_the_pixels_are_the_video_processors_own(full):
    _, processor, adapter = full
    for clip in CLIPS:
        frames = frames_of(*clip, seed=3)
        want = processor.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        batch = adapter.processor.preprocess("video", [frames])
        assert batch.inputs["grid_thw"].tolist() == want["video_grid_thw"].tolist()
        assert torch.equal(batch.inputs["pixel_values"], want["pixel_values_videos"]), clip


# --- VideoPatcher against every video processor class it stands in for ---------------------------------

#: (class name, settings) pairs: defaults, a small pixel range (frames enlarged), a per-frame cap, bilinear.
SETTINGS = [
    ("Qwen2VLVideoProcessor", {"size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}}),
    ("Qwen2VLVideoProcessor", {"size": {"shortest_edge": 112 * 112, "longest_edge": 224 * 224}}),
    ("Qwen2VLVideoProcessor", {"size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448},
                               "cap_pixels_per_frame": True, "max_video_tokens": 40}),
    ("Qwen2VLVideoProcessor", {"size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448}, "resample": 2}),
    ("Qwen3VLVideoProcessor", {"size": {"shortest_edge": 64 * 64, "longest_edge": 512 * 512 * 16}}),
    ("Qwen3VLVideoProcessor", {"size": {"shortest_edge": 64 * 64, "longest_edge": 512 * 512 * 16},
                               "cap_pixels_per_frame": True, "max_video_tokens": 30}),
    ("Glm4vVideoProcessor", {"size": {"shortest_edge": 56 * 56, "longest_edge": 448 * 448 * 8}}),
]
PATCHER_CLIPS = [(5, 70, 50), (4, 640, 360), (2, 30, 200), (3, 112, 112), (1, 41, 97)]


VIDEO_PROCESSOR_MODULES = {"Qwen2VLVideoProcessor": "qwen2_vl.video_processing_qwen2_vl",
                           "Qwen3VLVideoProcessor": "qwen3_vl.video_processing_qwen3_vl",
                           "Glm4vVideoProcessor": "glm4v.video_processing_glm4v"}


def real_video_processor(name: str, settings: dict):
    import importlib

    module = importlib.import_module(f"transformers.models.{VIDEO_PROCESSOR_MODULES[name]}")
    return getattr(module, name)(**settings)


def patcher_for(name: str, settings: dict) -> VideoPatcher:
    if name == "Qwen2VLVideoProcessor":  # its module imports torchvision: the settings twin stands in
        return VideoPatcher(qwen2_vl_video_settings_class()(**settings))
    return VideoPatcher(real_video_processor(name, settings))


def test_every_video_processor_class_stood_in_for_is_covered():
    assert sorted({name for name, _ in SETTINGS}) == sorted(CLIP_SIZING)


@pytest.mark.parametrize(("name", "settings"), SETTINGS, ids=lambda v: v if isinstance(v, str) else "")
def test_video_patcher_equals_the_torchvision_video_processor(name, settings):
    real = real_video_processor(name, settings)
    patcher = patcher_for(name, settings)
    for clip in PATCHER_CLIPS:
        frames = frames_of(*clip)
        try:
            want = real(videos=[frames], do_sample_frames=False, return_tensors="pt")
        except ValueError as refused:  # Qwen3-VL's sizing needs at least a temporal patch of frames
            with pytest.raises(ItemError, match=str(refused)):
                patcher.patches(frames)
            continue
        got, layout = patcher.patches(frames)
        assert [list(layout.grid_thw)] == want["video_grid_thw"].tolist(), (name, clip)
        assert torch.equal(got, want["pixel_values_videos"]), (name, clip, (got - want["pixel_values_videos"]).abs()
                                                               .max())


PATCHES_WITHOUT_TORCHVISION = """
import json, sys
import numpy as np
from transformers.utils import is_torchvision_available
from processors.base import ItemError
from tests.processors.test_video_parity import PATCHER_CLIPS, SETTINGS, frames_of, patcher_for

assert not is_torchvision_available()
sums = []
for name, settings in SETTINGS:
    patcher = patcher_for(name, settings)  # only running these classes needs torchvision, not their settings
    for clip in PATCHER_CLIPS:
        try:
            patches, layout = patcher.patches(frames_of(*clip))
        except ItemError as refused:
            sums.append(str(refused))
            continue
        np.save(sys.argv[1] + f"/{len(sums)}.npy", patches.numpy())
        sums.append(list(layout.grid_thw))
print(json.dumps(sums))
"""


def test_video_patcher_gives_the_same_values_without_torchvision(tmp_path):
    result = subprocess.run([sys.executable, "-c", PATCHES_WITHOUT_TORCHVISION, str(tmp_path)], cwd=ROOT,
                            env={**os.environ, **WITHOUT_TORCHVISION}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    grids = json.loads(result.stdout.strip().splitlines()[-1])
    index = 0
    for name, settings in SETTINGS:
        real = real_video_processor(name, settings)
        for clip in PATCHER_CLIPS:
            try:
                want = real(videos=[frames_of(*clip)], do_sample_frames=False, return_tensors="pt")
            except ValueError as refused:
                assert str(refused) in grids[index], (name, clip)
                index += 1
                continue
            assert [grids[index]] == want["video_grid_thw"].tolist(), (name, clip)
            got = torch.from_numpy(np.load(tmp_path / f"{index}.npy"))
            assert torch.equal(got, want["pixel_values_videos"]), (name, clip)
            index += 1
