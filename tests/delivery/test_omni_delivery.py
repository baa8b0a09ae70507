"""What the Omni families put on the wires, in-process: SGLang's fields for them, and rows whose width (and
deepstack) depends on the modality.

- SGLang frames: a video part carries `second_per_grid_ts` (temporal patch / `--video-fps`, what SGLang's
  `get_mm_data` hands `get_rope_index` for `qwen2_5_omni` and `qwen3_omni_moe`); an audio part's
  `grid_dim` is each clip's mel frames (SGLang turns them into the placeholder count with the model's
  formula, checked here against our row counts).
- Qwen3-Omni's image and video rows carry 2 deepstack blocks and its audio rows none: the native header,
  the response and `/server_info` say so per modality.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile
import torch

from encode_server.assembly import build_service
from encode_server.delivery.native_wire import NativeWire
from encode_server.delivery.sglang_wire import SglangWire, seconds_per_grid_step
from encode_server.delivery.wire import decode_header
from encode_server.models import BUILTIN_MODELS
from encode_server.ops.settings import Settings
from encode_server.records import EncodedPart, PartMeta
from tests.support.checkpoints.qwen_omni import sample_audio, sample_clips
from tests.support.sglang_frames import load

pytestmark = pytest.mark.quick

CPU, F32 = torch.device("cpu"), torch.float32
BUILTINS = ("tiny-qwen2.5-omni", "tiny-qwen3-omni")


@pytest.fixture(scope="module")
def adapters():
    return {name: BUILTIN_MODELS[name](CPU, F32) for name in BUILTINS}


def sglang_audio_rows(model_type: str, mel_frames: list[int]) -> list[int]:
    """SGLang 0.5.23's `QwenVLImageProcessor.get_mm_data`: audio feature lengths -> placeholder counts."""
    lens = torch.tensor(mel_frames)
    if model_type == "qwen3_omni_moe":
        leave = lens % 100
        feat = (leave - 1) // 2 + 1
        return (((feat - 1) // 2 + 1 - 1) // 2 + 1 + (lens // 100) * 13).tolist()
    after = (lens - 1) // 2 + 1
    return ((after - 2) // 2 + 1).tolist()


@pytest.mark.parametrize("name", BUILTINS)
def test_video_parts_carry_seconds_per_grid_step(adapters, name):
    adapter = adapters[name]
    assert seconds_per_grid_step(adapter, 2.0) == 1.0 and seconds_per_grid_step(adapter, 4.0) == 0.5
    clips = sample_clips()
    layouts = [adapter.processor.item_layout("video", clip) for clip in clips]
    rows = sum(layout.tokens for layout in layouts)
    part = EncodedPart(embedding=torch.zeros(rows, adapter.info.row_width_of("video")), layouts=tuple(layouts),
                       batch_size=1)
    frame = load(SglangWire(seconds_per_grid_step=seconds_per_grid_step(adapter, 2.0))
                 .success_frames(PartMeta("v", 0, 1, "video"), part)[0])
    assert frame.modality == 2 and frame.grid_dim.tolist() == [list(layout.grid_thw) for layout in layouts]
    assert frame.second_per_grid_ts.dtype == torch.float32 and frame.second_per_grid_ts.tolist() == [1.0, 1.0]
    assert frame.shape == [rows, adapter.info.row_width_of("video")]


@pytest.mark.parametrize("name", BUILTINS)
def test_audio_grid_is_mel_frames_that_sglang_counts_as_our_rows(adapters, name):
    adapter = adapters[name]
    clips = sample_audio("qwen3_omni_moe")
    prepared = adapter.processor.preprocess("audio", clips)
    frames = [layout.mel_frames for layout in prepared.layouts]
    assert sglang_audio_rows(adapter.info.family, frames) == [layout.tokens for layout in prepared.layouts]
    rows = adapter.forward(prepared)
    part = EncodedPart(embedding=rows, layouts=tuple(prepared.layouts), batch_size=1)
    header, payload = SglangWire(seconds_per_grid_step=1.0).success_frames(PartMeta("a", 0, 1, "audio"), part)
    frame = load(header)
    assert frame.modality == 3 and frame.grid_dim.tolist() == frames and frame.second_per_grid_ts is None
    assert frame.shape == [sum(layout.tokens for layout in prepared.layouts), adapter.info.hidden_size]
    assert len(payload) == rows.numel() * 4


def test_native_headers_say_the_deepstack_of_each_modality(adapters):
    adapter = adapters["tiny-qwen3-omni"]
    wire = NativeWire(adapter)
    for modality, deepstack in (("image", 2), ("video", 2), ("audio", 0)):
        width = adapter.info.row_width_of(modality)
        assert width == adapter.info.hidden_size * (1 + deepstack)
        part = EncodedPart(embedding=torch.zeros(3, width), layouts=(), batch_size=1)
        header = decode_header(wire.success_frames(PartMeta("r", 0, 1, modality), part)[0])
        assert header.deepstack == deepstack and header.shape == (3, width)
        failure = decode_header(wire.failure_frames(PartMeta("r", 0, 1, modality), 400, "bad")[0])
        assert failure.deepstack == deepstack and failure.shape == (0, width)


def wav_b64(clip: np.ndarray, rate: int) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, clip, rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


async def test_one_server_answers_all_three_modalities_with_their_own_row_widths(adapters):
    adapter = adapters["tiny-qwen3-omni"]
    service = build_service(Settings(model="tiny-qwen3-omni"), adapter)
    await service.start()
    try:
        clip = sample_audio("qwen3_omni_moe")[3]
        frames = sample_clips()[0]
        bodies = {
            "image": [png_b64(frames[0])],
            "video": [{"frames": [png_b64(frame) for frame in frames]}],
            "audio": [wav_b64(clip, 16000)],
        }
        info = service.server_info()["model"]
        assert info["modalities"] == ["image", "video", "audio"]
        assert info["row_widths"] == {"image": 384, "video": 384, "audio": 128}
        for modality, items in bodies.items():
            response = await service.encode({"req_id": f"omni-{modality}", "modality": modality, "mm_items": items,
                                             "return_embedding": True})
            assert response["embedding_shape"][1] == adapter.info.row_width_of(modality)
            assert response.get("deepstack", 0) == adapter.info.deepstack_of(modality)
            rows = torch.frombuffer(bytearray(base64.b64decode(response["embedding"])), dtype=torch.float32)
            item = {"image": frames[0], "video": frames, "audio": clip}[modality]
            want = adapter.forward(adapter.processor.preprocess(modality, [item]))
            assert torch.equal(rows.view(want.shape), want), modality
    finally:
        await service.stop()
