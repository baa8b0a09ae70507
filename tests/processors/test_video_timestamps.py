"""Video timestamps: the seconds of each temporal patch, as the model's own processor puts them into the prompt
(Qwen3-VL / Qwen3.5: `<t seconds>`; MiniMax-M3 VL: `]<]t seconds[>[`), for the frames this server samples
(docs/CONTRACT.md, section 2, "Response items").

1. The rules: golden values, and equality with `transformers`' `Qwen3VLProcessor` itself (the prompt text it
   writes, and the exact floats of the function it writes them from) and `MiniMaxM3VLProcessor` (the text of
   its video placeholder) for the same frames and metadata: several frame rates and frame counts, odd counts
   included (the last frame fills the last patch).
2. Sampling: a video file decoded by the server gives the stream's frame rate and the indices of the frames
   it took (checked against each frame's content); frames sent as images are taken at `--video-fps`.
3. Both wire formats, end to end: the HTTP response's and the native ZMQ header's items carry
   `video_timestamps`, and `--wire-format sglang` puts them in SGLang's `EmbeddingData.video_timestamps`
   (cached items too); models that do not use them send none.

The full processor's video path needs torchvision (installed with the test dependencies).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import re

import httpx
import numpy as np
import pytest
import torch

from encode_server.delivery.sglang_wire import SglangWire
from encode_server.media.decoding import MediaLimits, decode_frames, decode_video
from encode_server.models import ItemLayout
from encode_server.records import EncodedPart, PartMeta
from processors.video_clip import VideoClip, clip_timestamps, first_frame_timestamps, patch_timestamps
from tests.support.checkpoints.prompts import VISION_PROMPTS, build, prompt_timestamps
from tests.support.helpers import InProcessServer, Pull, png_bytes
from tests.support.sglang_frames import load
from tests.support.tiny_parts import clip

CPU, F32 = torch.device("cpu"), torch.float32

#: (frames_indices, fps, temporal patch size) -> each patch's seconds, worked by hand.
GOLDEN = [
    ((0, 1, 2, 3), 2.0, 2, (0.25, 1.25)),
    ((0, 1, 2), 2.0, 2, (0.25, 1.0)),  # odd: the last frame is repeated into the last patch
    ((0, 12, 24, 36, 48), 24.0, 2, (0.25, 1.25, 2.0)),
    ((0, 5, 10, 15, 20, 25, 30), 10.0, 2, (0.25, 1.25, 2.25, 3.0)),
    ((7,), 4.0, 2, (1.75,)),
    ((0, 3, 6, 9, 12, 15), 30.0, 3, (0.1, 0.4)),
]

#: (fps of the source, indices of the sampled frames) for the comparisons with transformers.
SAMPLINGS = [
    (2.0, list(range(4))),
    (2.0, list(range(5))),
    (24.0, [0, 12, 24, 36, 48]),
    (30000 / 1001, [0, 15, 30, 45, 60, 75, 90]),
    (25.0, [3, 40, 77]),
    (1.0, [0, 1]),
]


#: The same, each patch at its first frame (MiniMax-M3 VL).
GOLDEN_FIRST_FRAME = [
    ((0, 1, 2, 3), 2.0, 2, (0.0, 1.0)),
    ((0, 1, 2), 2.0, 2, (0.0, 1.0)),
    ((0, 12, 24, 36, 48), 24.0, 2, (0.0, 1.0, 2.0)),
    ((7,), 4.0, 2, (1.75,)),
    ((0, 3, 6, 9, 12, 15), 30.0, 3, (0.0, 0.3)),
]


@pytest.mark.parametrize("indices,fps,size,expected", GOLDEN)
def test_golden_patch_timestamps(indices, fps, size, expected):
    assert patch_timestamps(indices, fps, size) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("indices,fps,size,expected", GOLDEN_FIRST_FRAME)
def test_golden_first_frame_timestamps(indices, fps, size, expected):
    assert first_frame_timestamps(indices, fps, size) == pytest.approx(expected, abs=1e-12)


def test_a_clip_needs_one_index_per_frame_and_a_positive_rate():
    frames = clip(2, 32, 32, 1)
    with pytest.raises(ValueError, match="2 frames but 3"):
        VideoClip(frames, 2.0, [0, 1, 2])
    with pytest.raises(ValueError, match="positive"):
        VideoClip(frames, 0, [0, 1])
    assert clip_timestamps(frames, 2) is None  # plain frames say nothing of where they come from


def test_a_clip_pickles_with_its_metadata():
    original = VideoClip(clip(3, 16, 16, 2), 12.5, [0, 4, 9])
    copy = pickle.loads(pickle.dumps(original))
    assert type(copy) is VideoClip and (copy.fps, copy.frames_indices) == (12.5, (0, 4, 9)) and len(copy) == 3


# --- against transformers' Qwen3-VL processor -----------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoProcessor

    from encode_server.models.registry import load_checkpoint

    folder = build("qwen3_vl", tmp_path_factory.mktemp("timestamps") / "qwen3_vl")
    return load_checkpoint(folder, CPU, F32), AutoProcessor.from_pretrained(folder)


@pytest.mark.parametrize("fps,indices", SAMPLINGS, ids=lambda value: str(value))
def test_timestamps_are_what_the_transformers_processor_writes_for_the_same_frames(qwen3, fps, indices):
    adapter, processor = qwen3
    frames = clip(len(indices), 64, 48, len(indices))
    layout = adapter.processor.item_layout("video", VideoClip(frames, fps, indices))
    metadata = {"fps": fps, "frames_indices": list(indices), "total_num_frames": indices[-1] + 1}
    out = processor(text=[VISION_PROMPTS.prompt("video")], videos=[frames], video_metadata=[metadata],
                    do_sample_frames=False, return_tensors="pt")
    written = prompt_timestamps(processor.tokenizer.decode(out["input_ids"][0]))
    assert layout.grid_thw == tuple(out["video_grid_thw"][0].tolist())
    assert len(layout.video_timestamps) == layout.grid_thw[0] == len(written)
    assert [f"{seconds:.1f}" for seconds in layout.video_timestamps] == written
    # The exact floats of the function `replace_video_token` writes them from, with the processor's patch size.
    exact = processor._calculate_timestamps(list(indices), fps, processor.video_processor.temporal_patch_size)
    assert list(layout.video_timestamps) == exact
    video_token = processor.tokenizer.convert_tokens_to_ids(VISION_PROMPTS.token["video"])
    assert layout.tokens == int((out["input_ids"] == video_token).sum())


def test_fused_preprocess_keeps_each_clips_timestamps(qwen3):
    adapter, _ = qwen3
    clips = [VideoClip(clip(n, 64, 48, n), fps, indices) for n, (fps, indices) in
             ((4, SAMPLINGS[0]), (5, SAMPLINGS[2]), (3, SAMPLINGS[4]))]
    batch = adapter.processor.preprocess("video", clips)
    assert [layout.video_timestamps for layout in batch.layouts] == [
        adapter.processor.item_layout("video", item).video_timestamps for item in clips]
    assert adapter.forward(batch).shape[0] == batch.total_tokens


def test_families_whose_prefill_side_reads_no_timestamps_have_none():
    from encode_server.models.registry import builtin_models

    builtins = builtin_models()
    frames = VideoClip(clip(4, 64, 64, 3), 2.0, range(4))
    assert builtins["tiny-qwen3-vl"](CPU, F32).processor.item_layout("video", frames).video_timestamps == (0.25, 1.25)
    assert builtins["tiny-qwen2.5-vl"](CPU, F32).processor.item_layout("video", frames).video_timestamps is None
    assert builtins["tiny-glm4v"](CPU, F32).processor.item_layout("video", frames).video_timestamps is None
    assert "video_timestamps" not in ItemLayout(tokens=4, grid_thw=(1, 4, 4)).as_json()


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    from transformers import AutoProcessor

    from encode_server.models.registry import load_checkpoint
    from tests.support.checkpoints.minimax_m3_vl import minimax_m3_vl_checkpoint

    _, folder = minimax_m3_vl_checkpoint(tmp_path_factory.mktemp("timestamps") / "minimax_m3_vl")
    return load_checkpoint(folder, CPU, F32), AutoProcessor.from_pretrained(folder)


MINIMAX_STAMP = re.compile(r"\]<\]([^\[\]]*) seconds\[>\[")


@pytest.mark.parametrize("fps,indices", SAMPLINGS, ids=lambda value: str(value))
def test_minimax_timestamps_are_what_its_transformers_processor_writes(minimax, fps, indices):
    """Frames of whole merged patches (the full processor does not resize videos), the placeholder text of
    `MiniMaxM3VLProcessor.replace_video_token` for them and their metadata."""
    from transformers.video_utils import VideoMetadata

    adapter, processor = minimax
    frames = clip(len(indices), 56, 84, len(indices))
    layout = adapter.processor.item_layout("video", VideoClip(frames, fps, indices))
    metadata = VideoMetadata(total_num_frames=indices[-1] + 1, fps=fps, frames_indices=list(indices))
    inputs = processor.video_processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                                       do_resize=False, return_metadata=True, return_tensors="pt")
    written = MINIMAX_STAMP.findall(processor.replace_video_token(inputs, 0))
    assert len(layout.video_timestamps) == layout.grid_thw[0] == len(written)
    assert [f"{seconds:.1f}" for seconds in layout.video_timestamps] == written
    assert list(layout.video_timestamps) == [indices[min(2 * t, len(indices) - 1)] / fps for t in range(len(written))]


# --- what the decoders say about the frames they sampled ------------------------------------------

def video_file(frames: int, fps: int) -> bytes:
    """An MPEG-4 clip whose frame i is a flat grey of level 5 * i (so a decoded frame tells its index)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps, options={"qmin": "1", "qmax": "1"})  # greys within 1 level
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for index in range(frames):
            picture = np.full((48, 64, 3), 5 * index, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def source_index(frame) -> int:
    return round(float(np.asarray(frame, dtype=np.float64).mean()) / 5)


@pytest.mark.parametrize("frames,rate,video_fps,max_frames", [
    (50, 24, 2.0, 32),  # 2.08 s at 2 fps: 5 frames, an odd count
    (30, 10, 4.0, 32),  # 3 s at 4 fps: 12 frames
    (30, 10, 4.0, 7),   # capped to 7 frames spread over the clip
    (40, 25, 1.0, 32),  # 1.6 s at 1 fps: 2 frames
])
def test_a_video_file_gives_its_frame_rate_and_the_indices_of_the_frames_taken(qwen3, frames, rate, video_fps,
                                                                                max_frames):
    adapter, processor = qwen3
    data = video_file(frames, rate)
    sampled = decode_video(data, video_fps, max_frames, 10**7, "mm_items[0]")
    assert isinstance(sampled, VideoClip) and sampled.fps == rate
    assert list(sampled.frames_indices) == [source_index(frame) for frame in sampled]
    count = min(max_frames, int(np.ceil(frames / rate * video_fps)))
    assert len(sampled) == count
    targets = [index * (frames / rate) / count for index in range(count)]
    assert list(sampled.frames_indices) == [next(i for i in range(frames) if i / rate + 1e-6 >= target)
                                            for target in targets]
    layout = adapter.processor.item_layout("video", sampled)
    exact = processor._calculate_timestamps(list(sampled.frames_indices), float(rate), 2)
    assert list(layout.video_timestamps) == exact


def test_frames_sent_as_images_are_taken_at_the_video_fps():
    limits = MediaLimits(max_image_pixels=10**7, max_fetch_bytes=10**7, audio_sample_rate=16000,
                         max_audio_seconds=30, video_fps=4.0, max_video_frames=8, allow_private_urls=False,
                         allowed_local_media_dir=None)
    sampled = decode_frames([png_bytes(32, 32, seed) for seed in range(3)], limits, "mm_items[0]")
    assert isinstance(sampled, VideoClip) and (sampled.fps, sampled.frames_indices) == (4.0, (0, 1, 2))
    assert patch_timestamps(sampled.frames_indices, sampled.fps, 2) == (0.125, 0.5)


# --- the wire formats -----------------------------------------------------------------------------

def test_sglang_frames_carry_each_video_items_timestamps():
    layouts = (ItemLayout(tokens=8, grid_thw=(2, 4, 4), video_timestamps=(0.25, 1.25)),
               ItemLayout(tokens=3, grid_thw=(3, 2, 2), video_timestamps=(0.0, 1.0, 2.0)))
    part = EncodedPart(embedding=torch.zeros(11, 8), layouts=layouts, batch_size=1)
    frames = SglangWire().success_frames(PartMeta("v_local_part_0", 0, 1, "video"), part)
    obj = load(frames[0])
    assert obj.video_timestamps == [[0.25, 1.25], [0.0, 1.0, 2.0]]
    assert all(type(value) is float for stamps in obj.video_timestamps for value in stamps)
    assert obj.second_per_grid_ts is None and obj.grid_dim.tolist() == [[2, 4, 4], [3, 2, 2]]
    plain = EncodedPart(embedding=torch.zeros(8, 8), layouts=(ItemLayout(tokens=8, grid_thw=(2, 4, 4)),), batch_size=1)
    assert load(SglangWire().success_frames(PartMeta("w", 0, 1, "video"), plain)[0]).video_timestamps is None


def encode(server, pull: Pull, req_id: str, items: list) -> tuple[dict, list[bytes]]:
    response = httpx.post(server.url + "/encode", timeout=60, json={
        "req_id": req_id, "modality": "video", "mm_items": items, "prefill_host": "127.0.0.1",
        "embedding_port": pull.port})
    assert response.status_code == 200, response.text
    return response.json(), pull.receive()


@pytest.mark.parametrize("wire_format", ["native", "sglang"])
def test_both_wire_formats_deliver_the_timestamps_end_to_end(wire_format):
    mp4 = base64.b64encode(video_file(50, 24)).decode()  # 5 frames at 2 fps: 0, 10, 20, 30, 40 of 24 fps
    frames = {"frames": [base64.b64encode(png_bytes(64, 64, seed)).decode() for seed in range(3)]}  # at 4 fps
    expected = [[(0 / 24 + 10 / 24) / 2, (20 / 24 + 30 / 24) / 2, 40 / 24], [0.125, 0.5]]
    pull = Pull()
    try:
        with InProcessServer("--model", "tiny-qwen3-vl", "--wire-format", wire_format, "--video-fps", "4",
                             "--max-video-frames", "5", "--cache-bytes", "64000000") as server:
            first, first_frames = encode(server, pull, "first", [mp4, frames])
            again, again_frames = encode(server, pull, "again", [mp4, frames])
    finally:
        pull.close()
    for body, message in ((first, first_frames), (again, again_frames)):
        assert [item["video_timestamps"] for item in body["items"]] == expected
        if wire_format == "native":
            header = json.loads(message[0])
            assert header["items"] == body["items"]
        else:
            assert load(message[0]).video_timestamps == expected
    assert [item["cached"] for item in again["items"]] == [True, True]
