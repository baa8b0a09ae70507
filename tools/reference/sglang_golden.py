"""Golden frames for `--wire-format sglang`, made and checked by real SGLang (run in a side venv).

    generate: pickle SGLang's own `EmbeddingData` exactly as its encoder server does
              (`EmbeddingData(..., **aux)`, then `pickle.dumps(obj.copy_without_embedding())`) for the
              cases below, and write them to tests/golden/ with a manifest of the inputs; the CI test
              (tests/fronts/test_sglang_wire.py) renders the same inputs with `encode_server.delivery.sglang_wire` and
              compares bytes.
    check:    render the cases with `encode_server.delivery.sglang_wire` and unpickle them with SGLang's own
              `safe_pickle_loads`; they must come back as SGLang's classes with the right values, and
              merge through SGLang's `_aggregate_embedding_part`.

Run (from the repository root; VENV is the side venv that tools/compat/sglang_compat.sh builds, by default
`.sglang-venv`):

    PYTHONPATH=$PWD VENV/bin/python tools/reference/sglang_golden.py generate   # SGLang 0.5.23 as installed
    PYTHONPATH=$PWD VENV/bin/python tools/reference/sglang_golden.py check

and for 0.5.21 (where `Modality` is still defined in `schedule_batch`, our default class path):

    VENV/bin/pip download --no-deps sglang==0.5.21 -d /tmp/sgl521
    unzip -q /tmp/sgl521/sglang-0.5.21-*.whl 'sglang/*' -d /tmp/sgl521/tree
    PYTHONPATH=/tmp/sgl521/tree:$PWD VENV/bin/python tools/reference/sglang_golden.py generate
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import warnings
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden"
SEND_TIME = 1700000000.25  # fixed, so the bytes are reproducible

#: The inputs of every golden case; the CI test renders the same ones with our writer.
CASES = [
    {"name": "image", "kind": "embedding", "req_id": "req-7_local_part_0", "num_parts": 1, "part_idx": 0,
     "modality": "image", "grids": [[1, 4, 6], [1, 2, 2]], "dtype": "float32", "shape": [7, 32]},
    {"name": "video", "kind": "embedding", "req_id": "vid_local_part_1", "num_parts": 2, "part_idx": 1,
     "modality": "video", "grids": [[2, 4, 4]], "dtype": "bfloat16", "shape": [8, 64],
     "second_per_grid_ts": [1.0]},
    {"name": "audio", "kind": "embedding", "req_id": "aud", "num_parts": 1, "part_idx": 0,
     "modality": "audio", "grids": [37, 12], "dtype": "float16", "shape": [11, 16]},
    # Muse Spark: merged token grids and one timestamp (seconds) per temporal clip of each video.
    {"name": "video_timestamps", "kind": "embedding", "req_id": "muse_local_part_0", "num_parts": 2, "part_idx": 0,
     "modality": "video", "grids": [[2, 2, 3], [1, 1, 4]], "dtype": "bfloat16", "shape": [16, 64],
     "video_timestamps": [[0.0, 1.0], [0.0]]},
    {"name": "error", "kind": "error", "req_id": "bad_local_part_0", "num_parts": 2, "part_idx": 0,
     "modality": "image", "message": "item 0: cannot decode the image: cannot identify image file", "code": 400},
]


def _sglang():
    warnings.filterwarnings("ignore")
    import sglang
    from sglang.srt.disaggregation.encoder.receiver import EmbeddingData
    from sglang.srt.managers.schedule_batch import Modality

    return sglang.__version__, EmbeddingData, Modality


def generate() -> None:
    import torch

    version, EmbeddingData, Modality = _sglang()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    modalities = {"image": Modality.IMAGE, "video": Modality.VIDEO, "audio": Modality.AUDIO}
    GOLDEN.mkdir(parents=True, exist_ok=True)
    manifest_path = GOLDEN / "sglang_frames.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"versions": {}}
    files = {}
    for case in CASES:
        modality = modalities[case["modality"]]
        if case["kind"] == "embedding":
            aux = {"video_timestamps": None, "second_per_grid_ts": None}  # _build_mm_aux_data, every modality
            if "second_per_grid_ts" in case:
                aux["second_per_grid_ts"] = torch.tensor(case["second_per_grid_ts"], dtype=torch.float32)
            if "video_timestamps" in case:  # build_encoder_inputs (Muse): a list of per-video lists of floats
                aux["video_timestamps"] = case["video_timestamps"]
            data = EmbeddingData(case["req_id"], case["num_parts"], case["part_idx"],
                                 torch.tensor(case["grids"], dtype=torch.int64), modality,
                                 torch.zeros(case["shape"], dtype=dtypes[case["dtype"]]), **aux)
        else:  # MMEncoder._stage_errors
            data = EmbeddingData(case["req_id"], case["num_parts"], case["part_idx"], None, modality,
                                 error_msg=case["message"], error_code=case["code"])
        data.send_time = SEND_TIME
        frame = pickle.dumps(data.copy_without_embedding())  # MMEncoder._send
        name = f"sglang-{version}-{case['name']}.pkl"
        (GOLDEN / name).write_bytes(frame)
        files[case["name"]] = name
    manifest["send_time"] = SEND_TIME
    manifest["cases"] = CASES
    manifest["versions"][version] = {
        "embedding_class": f"{EmbeddingData.__module__}.{EmbeddingData.__qualname__}",
        "modality_class": f"{Modality.__module__}.{Modality.__qualname__}",
        "files": files,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {len(files)} frames of SGLang {version} to {GOLDEN}")


def check() -> None:
    import torch

    from encode_server.delivery.sglang_wire import SglangFrames

    version, EmbeddingData, Modality = _sglang()
    from sglang.srt.disaggregation.encoder.receiver import _aggregate_embedding_part
    from sglang.srt.utils.common import safe_pickle_loads

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    frames = SglangFrames()  # our defaults: the class paths every version since 0.5.21 resolves
    failures = 0
    for case in CASES:
        if case["kind"] == "embedding":
            header = frames.embedding_header(
                req_id=case["req_id"], part_idx=case["part_idx"], num_parts=case["num_parts"],
                modality=case["modality"], grids=case["grids"], dtype=dtypes[case["dtype"]], shape=case["shape"],
                second_per_grid_ts=case.get("second_per_grid_ts"), video_timestamps=case.get("video_timestamps"),
                send_time=SEND_TIME)
        else:
            header = frames.error_header(
                req_id=case["req_id"], part_idx=case["part_idx"], num_parts=case["num_parts"],
                modality=case["modality"], message=case["message"], code=case["code"], send_time=SEND_TIME)
        obj = safe_pickle_loads(header)
        problems = []
        if type(obj) is not EmbeddingData:
            problems.append(f"type {type(obj)}")
        if obj.modality is not getattr(Modality, case["modality"].upper()):
            problems.append(f"modality {obj.modality!r}")
        if (obj.req_id, obj.num_parts, obj.part_idx) != (case["req_id"], case["num_parts"], case["part_idx"]):
            problems.append("ids")
        if case["kind"] == "embedding":
            if not torch.equal(obj.grid_dim, torch.tensor(case["grids"], dtype=torch.int64)):
                problems.append(f"grid_dim {obj.grid_dim!r}")
            if obj.dtype is not dtypes[case["dtype"]] or obj.shape != case["shape"] or obj.error_msg is not None:
                problems.append(f"dtype/shape {obj.dtype} {obj.shape}")
            obj.embedding = torch.zeros(obj.shape, dtype=obj.dtype)
            merged = _aggregate_embedding_part(None, obj, "qwen2_5_vl")
            meta = merged.get_mm_extra_meta()
            if case.get("second_per_grid_ts") and meta.get("second_per_grid_ts") != case["second_per_grid_ts"]:
                problems.append(f"second_per_grid_ts {meta.get('second_per_grid_ts')!r}")
            if case.get("video_timestamps") and meta.get("video_timestamps") != case["video_timestamps"]:
                problems.append(f"video_timestamps {meta.get('video_timestamps')!r}")
        elif (obj.error_msg, obj.error_code, obj.grid_dim, obj.dtype, obj.shape) != (
                case["message"], case["code"], None, None, None):
            problems.append(f"error fields {obj.error_msg!r} {obj.error_code!r}")
        failures += bool(problems)
        print(f"{'PASS' if not problems else 'FAIL'}  SGLang {version} unpickles our {case['name']} frame"
              + (f": {'; '.join(problems)}" if problems else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("generate", "check"))
    {"generate": generate, "check": check}[parser.parse_args().action]()
