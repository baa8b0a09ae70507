"""`encode_server.delivery.sglang_wire`: frame 0 of SGLang's messages, byte for byte what SGLang's own encoder
pickles, without SGLang installed.

The golden frames in tests/golden/ were pickled by real SGLang (0.5.21 and 0.5.23) from its own
`EmbeddingData`, the way its encoder server does it; `tests/golden/sglang_frames.json` holds their
inputs. To regenerate them (and to check that real SGLang unpickles our frames into its classes),
build the side venv with `tools/compat/sglang_compat.sh` and run `tools/reference/sglang_golden.py generate` and
`tools/reference/sglang_golden.py check` as its docstring says.

Two things in a pickled tensor are not ours to fix: torch names a tensor's storage after its memory
address, so `canonical` below replaces that key (and the lengths that contain it) before comparing.
Nothing else is normalised. These tests unpickle only with `StandInUnpickler`, which resolves SGLang's
class paths to local stand-ins and refuses every other global but torch's tensor rebuilders.
"""

from __future__ import annotations

import json
import pickle
import pickletools

import pytest
import torch

from encode_server.delivery.sglang_wire import (
    EMBEDDING_CLASS,
    LEGACY_EMBEDDING_CLASS,
    MODALITY_CLASS,
    SglangFrames,
    check_class_path,
)
from tests.support import paths
from tests.support.sglang_frames import (
    ModalityStandIn,
    canonical,
    load,
)

pytestmark = pytest.mark.quick

GOLDEN = paths.GOLDEN
MANIFEST = json.loads((GOLDEN / "sglang_frames.json").read_text())
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: The globals SGLang 0.5.21+ lets `safe_pickle_loads` resolve that a frame may need (a subset of its
#: allowlist, copied from `sglang/srt/utils/common.py`).
SGLANG_ALLOWED = {
    ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
    ("sglang.srt.managers.schedule_batch", "Modality"),
    ("sglang.srt.multimodal.modality", "Modality"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("collections", "OrderedDict"),
    ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
}


def short_string(text: str) -> bytes:
    """`text` as pickle's SHORT_BINUNICODE opcode writes it."""
    return b"\x8c" + bytes([len(text)]) + text.encode()


def render(frames: SglangFrames, case: dict) -> bytes:
    if case["kind"] == "embedding":
        return frames.embedding_header(
            req_id=case["req_id"], part_idx=case["part_idx"], num_parts=case["num_parts"], modality=case["modality"],
            grids=case["grids"], dtype=DTYPES[case["dtype"]], shape=case["shape"],
            second_per_grid_ts=case.get("second_per_grid_ts"), video_timestamps=case.get("video_timestamps"),
            send_time=MANIFEST["send_time"])
    return frames.error_header(
        req_id=case["req_id"], part_idx=case["part_idx"], num_parts=case["num_parts"], modality=case["modality"],
        message=case["message"], code=case["code"], send_time=MANIFEST["send_time"])


def globals_named(frame: bytes) -> set[tuple[str, str]]:
    """(module, name) of every STACK_GLOBAL, from the two strings pushed before it (memo-aware)."""
    memo: dict[int, object] = {}
    stack: list[object] = []
    found = set()
    for opcode, arg, _ in pickletools.genops(frame):
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE"):
            stack.append(arg)
        elif opcode.name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif opcode.name in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif opcode.name == "STACK_GLOBAL":
            name, module = stack.pop(), stack.pop()
            found.add((module, name))
            stack.append(None)
        else:
            stack.append(None)
    return found


# --- byte identity with real SGLang -------------------------------------------------------------

@pytest.mark.parametrize("version", sorted(MANIFEST["versions"]))
@pytest.mark.parametrize("case", MANIFEST["cases"], ids=lambda case: case["name"])
def test_frames_are_byte_identical_to_sglangs_own(version, case):
    recorded = MANIFEST["versions"][version]
    frames = SglangFrames(recorded["embedding_class"], recorded["modality_class"])
    golden = (GOLDEN / recorded["files"][case["name"]]).read_bytes()
    assert canonical(render(frames, case)) == canonical(golden)


def test_defaults_are_sglang_0_5_21_exactly_and_0_5_23_up_to_the_modality_path():
    frames = SglangFrames()
    assert (frames.embedding_class, frames.modality_class) == (EMBEDDING_CLASS, MODALITY_CLASS)
    assert MANIFEST["versions"]["0.5.21"]["modality_class"] == MODALITY_CLASS
    for case in MANIFEST["cases"]:
        ours = canonical(render(frames, case))
        assert ours == canonical((GOLDEN / MANIFEST["versions"]["0.5.21"]["files"][case["name"]]).read_bytes())
        newer = canonical((GOLDEN / MANIFEST["versions"]["0.5.23"]["files"][case["name"]]).read_bytes())
        assert ours != newer
        assert ours.replace(short_string(MODALITY_CLASS.rsplit(".", 1)[0]),
                            short_string("sglang.srt.multimodal.modality")) == newer


def test_canonical_only_hides_the_storage_key():
    frames = SglangFrames()
    case = MANIFEST["cases"][0]
    first, second = render(frames, case), render(frames, {**case, "grids": [[1, 4, 6], [1, 2, 4]]})
    assert canonical(first) != canonical(second)
    assert canonical(first) == canonical(render(frames, case))


# --- what the frames hold -----------------------------------------------------------------------

def test_success_frame_state_in_sglangs_order():
    header = SglangFrames().embedding_header(req_id="r_local_part_1", part_idx=1, num_parts=3, modality="image",
                                             grids=[(1, 4, 6), (1, 2, 2)], dtype=torch.bfloat16, shape=(7, 32))
    obj = load(header)
    assert list(vars(obj)) == ["req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time",
                               "dtype", "shape", "_mr_ptr", "error_msg", "error_code", "video_timestamps",
                               "second_per_grid_ts"]
    assert (obj.req_id, obj.num_parts, obj.part_idx) == ("r_local_part_1", 3, 1)
    assert obj.grid_dim.dtype == torch.int64 and obj.grid_dim.tolist() == [[1, 4, 6], [1, 2, 2]]
    assert type(obj.modality) is ModalityStandIn and obj.modality == 1
    assert obj.dtype is torch.bfloat16 and obj.shape == [7, 32]
    assert obj.embedding is None and obj.error_msg is None and obj.error_code is None
    assert isinstance(obj.send_time, float) and obj.send_time > 1.6e9


def test_audio_grid_is_mel_frame_lengths_and_video_carries_seconds_per_grid():
    frames = SglangFrames()
    audio = load(frames.embedding_header(req_id="a", part_idx=0, num_parts=1, modality="audio", grids=[300, 17],
                                         dtype=torch.float32, shape=(80, 8)))
    assert audio.grid_dim.shape == (2,) and audio.grid_dim.tolist() == [300, 17] and audio.modality == 3
    video = load(frames.embedding_header(req_id="v", part_idx=0, num_parts=1, modality="video",
                                         grids=torch.tensor([[2, 4, 4], [4, 2, 2]]), dtype=torch.float32,
                                         shape=(12, 8), second_per_grid_ts=[1.0, 0.5]))
    assert video.modality == 2 and video.grid_dim.tolist() == [[2, 4, 4], [4, 2, 2]]
    assert video.second_per_grid_ts.dtype == torch.float32 and video.second_per_grid_ts.tolist() == [1.0, 0.5]


def test_error_frame_carries_message_and_status_and_no_tensor_fields():
    obj = load(SglangFrames().error_header(req_id="bad", part_idx=0, num_parts=2, modality="video",
                                           message="item 1: not a video", code=400))
    assert list(vars(obj)) == ["req_id", "num_parts", "part_idx", "grid_dim", "modality", "embedding", "send_time",
                               "dtype", "shape", "_mr_ptr", "error_msg", "error_code"]
    assert (obj.error_msg, obj.error_code, obj.modality) == ("item 1: not a video", 400, 2)
    assert obj.grid_dim is None and obj.dtype is None and obj.shape is None and obj.embedding is None


def test_frames_name_only_globals_on_sglangs_allowlist():
    frames = SglangFrames()
    for case in MANIFEST["cases"]:
        assert globals_named(render(frames, case)) <= SGLANG_ALLOWED


def test_legacy_class_path_for_sglang_0_5_12_to_0_5_18():
    header = SglangFrames(LEGACY_EMBEDDING_CLASS).error_header(
        req_id="x", part_idx=0, num_parts=1, modality="image", message="m", code=500)
    assert ("sglang.srt.disaggregation.encode_receiver", "EmbeddingData") in globals_named(header)
    assert load(header).error_code == 500


@pytest.mark.parametrize("path", ["EmbeddingData", "sglang..EmbeddingData", "sglang.x-y.EmbeddingData", "",
                                  "sglang.srt.EmbeddingData; import os", ".sglang.EmbeddingData"])
def test_class_paths_must_be_dotted_identifiers(path):
    with pytest.raises(ValueError):
        check_class_path(path)
    with pytest.raises(ValueError):
        SglangFrames(path)


def test_a_non_dtype_is_refused():
    with pytest.raises(TypeError):
        SglangFrames().embedding_header(req_id="r", part_idx=0, num_parts=1, modality="image", grids=[(1, 2, 2)],
                                        dtype="float32", shape=(1, 8))


# --- the fast path (C pickler, class references renamed) against the reference pickler --------------

@pytest.mark.parametrize("req_id", [
    "r", "x" * 300, "émoji-🙂_local_part_3", "\x8c\x22encode_server.delivery.sglang_wire\x94 modality",
    "sglang.srt.managers.schedule_batch Modality _ModalityClassStandIn",
])
@pytest.mark.parametrize("modality,grids,seconds", [
    ("image", [(1, 4, 6)], None), ("video", [(2, 4, 4), (8, 30, 52)], [1.0, 0.5]), ("audio", [3000, 7], None),
    ("image", [(1, 2, 2)] * 2000, None),  # beyond one pickle frame: the reference path answers
])
def test_fast_path_gives_the_reference_picklers_bytes(req_id, modality, grids, seconds):
    from encode_server.delivery import sglang_wire

    for frames in (SglangFrames(), SglangFrames(LEGACY_EMBEDDING_CLASS, "sglang.srt.multimodal.modality.Modality")):
        header = frames.embedding_header(req_id=req_id, part_idx=1, num_parts=2, modality=modality, grids=grids,
                                         dtype=torch.float16, shape=(70000, 3584), second_per_grid_ts=seconds,
                                         send_time=12.5)
        stand_in = sglang_wire._EmbeddingDataStandIn()
        stand_in.__dict__.update(load(header).__dict__)
        stand_in.modality = sglang_wire._ModalityMember(int(stand_in.modality))
        assert canonical(header) == canonical(frames._reference_dumps(stand_in))
        assert load(header).req_id == req_id
        error = frames.error_header(req_id=req_id, part_idx=0, num_parts=1, modality=modality, message=req_id,
                                    code=502, send_time=1.0)
        assert (load(error).error_msg, load(error).error_code) == (req_id, 502)


def test_fast_path_is_taken_for_ordinary_frames_and_not_beyond_one_frame():
    from encode_server.delivery import sglang_wire

    frames = SglangFrames()

    def stand_in(grids):
        obj = sglang_wire._EmbeddingDataStandIn()
        obj.__dict__.update({"req_id": "r", "grid_dim": sglang_wire.grid_tensor(grids),
                             "modality": sglang_wire._ModalityMember(1)})
        return obj

    small, huge = stand_in([(1, 4, 4)]), stand_in([(1, 2, 2)] * 4000)
    renamed = frames._retarget(pickle.dumps(small, protocol=4))
    assert renamed is not None and canonical(renamed) == canonical(frames._reference_dumps(small))
    assert frames._retarget(pickle.dumps(huge, protocol=4)) is None
    assert frames._retarget(b"\x80\x04N.") is None


# --- templates: one pickle per kind of message, each message's id and time spliced in -------------------

@pytest.mark.parametrize("req_id", ["r", "é" * 127 + "x", "y" * 255, "z" * 256, "w" * 70000, "req_id", "image",
                                    "\x00encode-server:req-id\x00", "émoji-🙂_part_0", "surrogate-\ud800"])
@pytest.mark.parametrize("modality,grids,seconds,stamps", [
    ("image", [(1, 4, 4)], None, None), ("image", [[1, 4, 6], (1, 2, 2)], None, None),
    ("video", [(2, 4, 4)], [1.0], [[0.0, 0.5]]), ("audio", [3000, 7], None, None),
])
def test_a_templated_header_is_the_picklers_own(req_id, modality, grids, seconds, stamps):
    frames = SglangFrames()
    fields = dict(part_idx=0, num_parts=1, modality=modality, grids=grids, dtype=torch.float32, shape=(16, 128),
                  second_per_grid_ts=seconds, video_timestamps=stamps)
    frames.embedding_header(req_id="warm", send_time=1.0, **fields)  # makes the template
    # A request's id is parsed from its body: a string of its own, never one of the pickle's interned names (the
    # literal "req_id" here is the key's own object, which the pickler would write as a memo reference instead).
    parsed = "".join(list(req_id))
    for send_time in (1764170000.123456, 0.0):
        header = frames.embedding_header(req_id=req_id, send_time=send_time, **fields)
        reference = frames._embedding_dumps(req_id=parsed, send_time=send_time, **fields)
        assert canonical(header) == canonical(reference)
        assert (load(header).req_id, load(header).send_time) == (req_id, send_time)


def test_templates_are_kept_per_kind_of_message_and_bounded(monkeypatch):
    from encode_server.delivery import sglang_wire

    monkeypatch.setattr(sglang_wire, "TEMPLATES_KEPT", 3)
    frames = SglangFrames()
    made = []
    original = frames._template
    monkeypatch.setattr(frames, "_template", lambda key, **fields: made.append(key) or original(key, **fields))
    for index in range(4):
        frames.embedding_header(req_id=f"r{index}", part_idx=0, num_parts=1, modality="image", grids=[(1, 4, 4)],
                                dtype=torch.float32, shape=(4, 8))
    assert len(made) == 1  # the same kind of message: one template
    for width in (2, 4, 6, 8):
        frames.embedding_header(req_id="r", part_idx=0, num_parts=1, modality="image", grids=[(1, 2, width)],
                                dtype=torch.float32, shape=(width // 2, 8))
    assert len(made) == 5 and len(frames._templates) == 3
    tensor_grids = frames.embedding_header(req_id="t", part_idx=0, num_parts=1, modality="image",
                                           grids=torch.tensor([[1, 4, 4]]), dtype=torch.float32, shape=(4, 8))
    assert len(made) == 5 and load(tensor_grids).grid_dim.tolist() == [[1, 4, 4]]  # a tensor: no template
