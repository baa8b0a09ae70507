"""`--wire-format sglang` end to end (docs/CONTRACT.md section 3): a real server, plain pyzmq PULL
sockets standing in for SGLang's prefill side, and SGLang's request forms: the `zmq_to_tokenizer` form
(`prefill_host` + an int `embedding_port`), the `zmq_to_scheduler` form (`prefill_host` with
`"embedding_port": null`, its ranks registering `host:port` / `[v6]:port` with `receive_count`), and
its extra fields (`encoder_idx`, `encoder_url`, `time_stats_json`, `modality` in registrations).

Frame 0 is read with the restricted stand-in unpickler of tests/support/sglang_frames.py and compared with
what `SglangFrames` writes for the same values (itself byte-identical to SGLang's own pickles there).
The real SGLang receiver is exercised by tools/compat/sglang_compat.py (not in CI: it needs SGLang).
"""

from __future__ import annotations

import base64
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from encode_server.delivery.sglang_wire import SglangFrames, SglangWire, seconds_per_grid_step
from encode_server.models import BUILTIN_MODELS, ItemLayout
from encode_server.records import EncodedPart, PartMeta
from tests.support.helpers import InProcessServer, Pull, image_b64
from tests.support.sglang_frames import canonical, load

SEND_TIMEOUT = 1.5


def tiny_qwen25_vl(device: torch.device, dtype: torch.dtype):
    return BUILTIN_MODELS["tiny-qwen2.5-vl"](device, dtype)


def tiny_qwen2_audio(device: torch.device, dtype: torch.dtype):
    return BUILTIN_MODELS["tiny-qwen2-audio"](device, dtype)
SGLANG_EXTRAS = {"encoder_idx": 0, "encoder_url": "http://127.0.0.1:1", "time_stats_json": '{"x": 1}'}


@pytest.fixture(scope="module")
def server():
    with InProcessServer("--wire-format", "sglang", "--send-timeout-s", str(SEND_TIMEOUT)) as process:
        yield process


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/encode", json=body, timeout=60)


def register(server, req_id: str, pull: Pull, count: int) -> httpx.Response:
    return httpx.post(server.url + "/scheduler_receive_url", json={
        "req_id": req_id, "receive_url": pull.receive_url, "receive_count": count, "modality": "IMAGE"})


def expected_header(obj, req_id: str, part_idx: int, num_parts: int, modality: str, grids, response: dict,
                    seconds=None) -> bytes:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[response["dtype"]]
    return SglangFrames().embedding_header(req_id=req_id, part_idx=part_idx, num_parts=num_parts, modality=modality,
                                           grids=grids, dtype=dtype, shape=response["embedding_shape"],
                                           second_per_grid_ts=seconds, send_time=obj.send_time)


# --- zmq_to_tokenizer: an int embedding_port --------------------------------------------------

def test_tokenizer_form_gets_sglangs_two_frames_with_our_bytes(server):
    pull = Pull()
    try:
        items = [image_b64(56, 84, seed=1), image_b64(112, 56, seed=2)]
        response = post(server, {"req_id": "tok_local_part_0", "modality": "IMAGE", "mm_items": items, "num_parts": 1,
                                 "part_idx": 0, "prefill_host": "127.0.0.1", "embedding_port": pull.port,
                                 "return_embedding": True, **SGLANG_EXTRAS})
        assert response.status_code == 200, response.text
        body = response.json()
        frames = pull.receive()
    finally:
        pull.close()
    assert len(frames) == 2
    assert frames[1] == base64.b64decode(body["embedding"])
    obj = load(frames[0])
    grids = [item["grid_thw"] for item in body["items"]]
    assert obj.grid_dim.tolist() == grids and obj.modality == 1 and obj.shape == body["embedding_shape"]
    assert obj.second_per_grid_ts is None and obj.video_timestamps is None
    expected = expected_header(obj, "tok_local_part_0", 0, 1, "image", grids, body)
    assert canonical(frames[0]) == canonical(expected)


def test_video_carries_qwen25_seconds_per_grid(server):
    pull = Pull()
    try:
        frame = image_b64(56, 56, seed=3)
        response = post(server, {"req_id": "vid_local_part_1", "modality": "VIDEO", "num_parts": 2, "part_idx": 1,
                                 "mm_items": [{"frames": [frame] * 4}], "prefill_host": "127.0.0.1",
                                 "embedding_port": pull.port, "return_embedding": True, **SGLANG_EXTRAS})
        assert response.status_code == 200, response.text
        frames = pull.receive()
    finally:
        pull.close()
    body = response.json()
    obj = load(frames[0])
    assert obj.modality == 2 and (obj.part_idx, obj.num_parts) == (1, 2)
    assert obj.grid_dim.tolist() == [body["items"][0]["grid_thw"]] and obj.grid_dim.tolist()[0][0] == 2
    assert obj.second_per_grid_ts.tolist() == [1.0]  # temporal patch 2 / --video-fps 2
    assert frames[1] == base64.b64decode(body["embedding"])


# --- zmq_to_scheduler: a null embedding_port, ranks register ---------------------------------------

def _encode_in_background(server, body: dict) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run() -> None:
        started = time.monotonic()
        result["response"] = post(server, body)
        result["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_scheduler_form_waits_for_both_ranks_and_sends_each_the_same_frames(server):
    ranks = [Pull("127.0.0.1"), Pull("::1")]
    try:
        items = [image_b64(56, 84, seed=4)]
        reference = post(server, {"req_id": "ref-sched", "modality": "image", "mm_items": items,
                                  "return_embedding": True}).json()
        thread, result = _encode_in_background(server, {
            "req_id": "sched_local_part_0", "modality": "IMAGE", "mm_items": items, "num_parts": 1, "part_idx": 0,
            "prefill_host": "127.0.0.1", "embedding_port": None, **SGLANG_EXTRAS})
        time.sleep(0.3)  # the encode is done and waiting for its receivers
        assert register(server, "sched_local_part_0", ranks[0], 2).json()["registered"] == 1
        assert register(server, "sched_local_part_0", ranks[1], 2).json()["registered"] == 2
        received = [rank.receive() for rank in ranks]
        thread.join(30)
    finally:
        for rank in ranks:
            rank.close()
    assert result["response"].status_code == 200, result["response"].text
    assert len(received[0]) == 2 and received[0][1] == received[1][1] == base64.b64decode(reference["embedding"])
    assert canonical(received[0][0]) == canonical(received[1][0])
    obj = load(received[0][0])
    assert obj.req_id == "sched_local_part_0" and obj.grid_dim.tolist() == [reference["items"][0]["grid_thw"]]


def test_scheduler_form_nobody_registers_is_502_after_the_send_timeout_and_late_ranks_hear_of_it(server):
    started = time.monotonic()
    response = post(server, {"req_id": "lonely_local_part_0", "modality": "image", "mm_items": [image_b64(56, 56)],
                             "prefill_host": "127.0.0.1", "embedding_port": None})
    elapsed = time.monotonic() - started
    assert response.status_code == 502 and "receive_count" in response.json()["message"]
    assert SEND_TIMEOUT <= elapsed < SEND_TIMEOUT + 3
    late = Pull()
    try:
        assert register(server, "lonely_local_part_0", late, 1).status_code == 200
        frames = late.receive(timeout_s=1.0)
    finally:
        late.close()
    obj = load(frames[0])
    assert len(frames) == 1 and (obj.error_code, obj.error_msg) == (502, response.json()["message"])


def test_corrupt_image_fails_ranks_registered_before_and_after_within_a_second(server):
    early, late = Pull("127.0.0.1"), Pull("::1")
    try:
        assert register(server, "bad_local_part_0", early, 2).status_code == 200
        response = post(server, {"req_id": "bad_local_part_0", "modality": "image", "prefill_host": "127.0.0.1",
                                 "embedding_port": None, "mm_items": [base64.b64encode(b"not an image").decode()]})
        answered = time.monotonic()
        assert response.status_code == 400
        assert register(server, "bad_local_part_0", late, 2).status_code == 200
        got = [early.receive(timeout_s=1.0), late.receive(timeout_s=1.0)]
        assert time.monotonic() - answered < 1.0
    finally:
        early.close()
        late.close()
    for frames in got:
        obj = load(frames[0])
        assert len(frames) == 1
        assert (obj.error_code, obj.error_msg) == (400, response.json()["message"])
        assert obj.grid_dim is None and obj.dtype is None and obj.shape is None and obj.embedding is None


def test_native_receiver_fed_by_an_sglang_encoder_fails_at_once_naming_the_fix(server):
    """The mismatch a new user hits: our EmbeddingReceiver behind an encoder started with --wire-format sglang.
    The get fails within seconds (not its 30 s timeout) and says what to change."""
    from encode_server.receiver import EmbeddingReceiver, WireFormatMismatch

    with EmbeddingReceiver() as receiver:
        response = post(server, {"req_id": "mixed-up", "modality": "image", "mm_items": [image_b64(56, 56)],
                                 "prefill_host": "127.0.0.1", "embedding_port": receiver.port})
        assert response.status_code == 200
        started = time.monotonic()
        with pytest.raises(WireFormatMismatch, match="--wire-format native"):
            receiver.get("mixed-up", timeout=30)
        assert time.monotonic() - started < 5


def test_embedding_port_without_prefill_host_is_still_400(server):
    response = post(server, {"req_id": "nohost", "modality": "image", "mm_items": [image_b64(56, 56)],
                             "embedding_port": 5555})
    assert response.status_code == 400 and "prefill_host" in response.json()["message"]


def test_server_info_reports_the_wire_format(server):
    settings = httpx.get(server.url + "/server_info").json()["settings"]
    assert settings["wire_format"] == "sglang"
    assert settings["sglang_embedding_class"] == "sglang.srt.disaggregation.encoder.receiver.EmbeddingData"


# --- the wire's inputs from the models, in-process --------------------------------------------

def test_audio_grid_is_the_processors_mel_frame_lengths():
    adapter = tiny_qwen2_audio(torch.device("cpu"), torch.float32)
    clips = [np.zeros(16000, dtype=np.float32), np.zeros(5000, dtype=np.float32)]
    layouts = [adapter.processor.item_layout("audio", clip) for clip in clips]
    hop = adapter.processor.hop_length
    assert [layout.mel_frames for layout in layouts] == [-(-len(clip) // hop) for clip in clips]
    prepared = adapter.processor.preprocess("audio", clips)
    assert [layout.mel_frames for layout in prepared.layouts] == [layout.mel_frames for layout in layouts]
    assert prepared.layouts == layouts
    rows = sum(layout.tokens for layout in layouts)
    part = EncodedPart(embedding=torch.zeros(rows, 8), layouts=tuple(layouts), batch_size=1)
    frames = SglangWire().success_frames(PartMeta("aud", 0, 1, "audio"), part)
    obj = load(frames[0])
    assert obj.modality == 3 and obj.grid_dim.tolist() == [layout.mel_frames for layout in layouts]
    assert len(frames[1]) == rows * 8 * 4


def test_audio_layout_without_mel_frames_is_refused():
    part = EncodedPart(embedding=torch.zeros(3, 8), layouts=(ItemLayout(3, (1, 1, 3)),), batch_size=1)
    with pytest.raises(ValueError, match="mel-frame"):
        SglangWire().success_frames(PartMeta("aud", 0, 1, "audio"), part)


def test_seconds_per_grid_step_only_for_qwen25_vl():
    assert seconds_per_grid_step(tiny_qwen25_vl(torch.device("cpu"), torch.float32), 2.0) == 1.0
    assert seconds_per_grid_step(tiny_qwen25_vl(torch.device("cpu"), torch.float32), 4.0) == 0.5
    assert seconds_per_grid_step(tiny_qwen2_audio(torch.device("cpu"), torch.float32), 2.0) is None


def test_failure_is_one_frame_and_success_two():
    wire = SglangWire()
    meta = PartMeta("r", 0, 1, "image")
    assert len(wire.failure_frames(meta, 400, "bad")) == 1
    part = EncodedPart(embedding=torch.zeros(4, 8, dtype=torch.bfloat16), layouts=(ItemLayout(4, (1, 4, 4)),),
                       batch_size=1)
    frames = wire.success_frames(meta, part)
    assert len(frames) == 2 and len(frames[1]) == 4 * 8 * 2 and load(frames[0]).dtype is torch.bfloat16
