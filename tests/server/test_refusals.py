"""Every refusal names its remedy: a limit names the flag that raises it, a modality the model does not
encode names the models that do, and a bad start-up (a device this torch cannot use, an unknown device,
a folder that does not exist) is one line on stderr saying what to do, with no traceback."""

from __future__ import annotations

import base64
import io
import subprocess

import httpx
import numpy as np
import pytest
import torch

from encode_server.fronts.bodies import read_limited
from encode_server.media.decoding import MediaError, decode_audio, decode_image
from encode_server.media.url_guard import resolve_local_path
from encode_server.models import DeviceError, load_adapter
from encode_server.models.base import resolve_device
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import builtin_models
from encode_server.records import EncodeError
from tests.support.helpers import InProcessServer, image_b64, png_bytes, run_python_module


def run_server(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_python_module("encode_server", *args, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The process failed with one line on stderr (log lines aside) and no traceback; that line."""
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("encode-server")]
    assert len(lines) == 1, done.stderr
    return lines[0]


# --- start-up -------------------------------------------------------------------------------------

def test_cuda_on_a_torch_that_cannot_use_it_says_how_to_get_one():
    """For real on this machine: its torch is a CPU build, so --device cuda is what a new user tries first.
    (On a torch with CUDA, a device index past the last GPU gives the same kind of line.)"""
    if torch.version.cuda is None:
        line = one_line_error(run_server("--device", "cuda"))
        assert "CUDA is not available in this torch build" in line
        assert "a CUDA build of torch from the PyTorch package index" in line
        assert "download.pytorch.org/whl/cu" in line and "--device cpu" in line
    else:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        line = one_line_error(run_server("--device", f"cuda:{visible}"))
        assert "--device cpu" in line or "visible" in line


def test_the_other_cuda_failures_name_their_cause(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="sees no GPU.*nvidia-smi.*--gpus all.*--device cpu"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(DeviceError, match="3 CUDA devices are needed .* but 2 are visible"):
        resolve_device("cuda:2")
    with pytest.raises(DeviceError, match="4 CUDA devices are needed"):
        resolve_device("cuda", ranks=4)  # --tp-size 4: one GPU per rank


def test_an_unknown_device_names_the_accepted_values():
    line = one_line_error(run_server("--device", "gpu"))
    assert "'gpu'" in line and "auto, cpu, cuda or cuda:N" in line


def test_a_folder_that_does_not_exist_is_said_so():
    line = one_line_error(run_server("--model", "./no/such/folder", "--log-level", "warning"))
    assert "./no/such/folder" in line and "does not exist" in line and "unknown model" not in line


@pytest.mark.parametrize("model", ["tiny-qwen-nope", "no_such_model"])
def test_a_name_that_is_neither_builtin_nor_a_folder_is_an_unknown_model_listing_the_builtins(model):
    with pytest.raises(CheckpointError) as refused:
        load_adapter(model, "cpu")
    message = str(refused.value)
    assert message.startswith(f"unknown model {model!r}") and all(name in message for name in builtin_models())


def test_a_file_is_not_a_checkpoint_folder(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        load_adapter(str(weights), "cpu")


# --- limits name their flag -------------------------------------------------------------------------

async def _chunks(*parts: bytes):
    for part in parts:
        yield part


async def test_a_body_over_the_limit_names_max_request_bytes():
    for declared, parts in (("5000", [b"x" * 10]), (None, [b"x" * 600, b"x" * 600])):
        with pytest.raises(EncodeError) as refused:
            await read_limited(declared, _chunks(*parts), 1000)
        assert refused.value.status == 413 and "--max-request-bytes" in refused.value.message


def test_decode_limits_name_their_flags():
    with pytest.raises(MediaError, match="--max-image-pixels"):
        decode_image(png_bytes(100, 100), 5000, "mm_items[0]")
    import soundfile

    clip = io.BytesIO()
    soundfile.write(clip, np.zeros(16000, np.float32), 16000, format="WAV")
    with pytest.raises(MediaError, match="--max-audio-seconds"):
        decode_audio(clip.getvalue(), 16000, 0.5, "mm_items[0]")


def test_a_local_file_outside_the_media_folder_names_the_flag(tmp_path):
    (tmp_path / "media").mkdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(8, 8))
    with pytest.raises(PermissionError, match="--allowed-local-media-dir"):
        resolve_local_path(str(outside), str(tmp_path / "media"))


def test_through_the_server_each_refusal_names_its_remedy():
    limits = ("--max-request-bytes", "60000", "--max-image-pixels", "5000", "--max-video-frames", "2",
              "--req-timeout-s", "10", "--max-priority", "3")
    small = image_b64(56, 56)
    with InProcessServer(*limits) as server:
        def refusal(body: dict, status: int = 400) -> str:
            response = httpx.post(server.url + "/encode", json=body, timeout=60)
            assert response.status_code == status, response.text
            return response.json()["message"]

        base = {"req_id": "r", "modality": "image"}
        assert "--max-request-bytes" in refusal({**base, "mm_items": [image_b64(200, 200)]}, status=413)
        assert "--max-image-pixels" in refusal({**base, "mm_items": [image_b64(100, 100)]})
        frames = {"frames": [small, small, small]}
        assert "--max-video-frames" in refusal({**base, "modality": "video", "mm_items": [frames]})
        assert "--req-timeout-s" in refusal({**base, "mm_items": [small], "timeout_s": 60})
        assert "--max-priority" in refusal({**base, "mm_items": [small], "priority": 4})
        clip = base64.b64encode(b"RIFF....WAVE").decode()
        audio = refusal({**base, "modality": "audio", "mm_items": [clip]})
        assert "does not encode audio" in audio and "--model tiny-qwen2-audio" in audio
        assert httpx.post(server.url + "/encode", json={**base, "mm_items": [small]}, timeout=60).status_code == 200
