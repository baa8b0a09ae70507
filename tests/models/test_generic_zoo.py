"""Models served by the generic path, built as the model zoo builds them (`tests/support/zoo/build.py`: a shrunk config,
`save_pretrained`, the processor with an offline tokenizer) and compared with the zoo's reference (the full
model's `inputs_embeds` at the placeholder positions, `tests/support/zoo/compare.py`):

- audio-only models (Qwen3-ASR, GLM-ASR, Voxtral) served by the real server become healthy (the health probe
  and the preprocessing workers' warm-up send a sample clip, not an image) and answer each clip with the model's
  rows;
- HunYuan-VL, whose processor refuses a bare `<|image|>`, is probed and served with the framed placeholder
  `<|image_start|><|image|><|image_end|>` its processor asks for, exactly.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from encode_server.models.generic.adapter import GenericAdapter
from encode_server.models.registry import load_checkpoint
from tests.support.helpers import ServerProcess, decode_embedding, rel_diff

CPU, F32 = torch.device("cpu"), torch.float32


def zoo_folder(model_type: str, root: Path) -> tuple[Path, dict]:
    """The zoo's tiny checkpoint of this type, and its manifest (the placeholder token and its id)."""
    from tests.support.zoo.build import build

    folder = root / model_type
    return folder, build(model_type, folder)


def zoo_reference(folder: Path, manifest: dict, modality: str, items: list) -> list[torch.Tensor]:
    """Per item, the rows the full model's language model receives at the placeholder positions."""
    import transformers
    from transformers import AutoProcessor

    from tests.support.zoo.compare import load_reference_model, reference_all, sampling_rate

    model = load_reference_model(getattr(transformers, manifest["model_class"]), folder)
    processor = AutoProcessor.from_pretrained(folder)
    token, token_id = manifest["tokens"][modality]
    return reference_all(model, processor, modality, token, token_id, items, sampling_rate(processor))


def wav_b64(clip: np.ndarray, rate: int) -> str:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, clip, rate, format="WAV", subtype="FLOAT")  # float samples: decoded back bit for bit
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(("model_type", "workers"), [("qwen3_asr", "0"), ("glmasr", "1"), ("voxtral", "0")])
def test_an_audio_only_model_becomes_healthy_and_serves_the_models_rows(model_type, workers, tmp_path):
    """Voxtral's processor takes audio only in a chat request (its tokenizer, `mistral_common`'s, writes the
    audio tokens and pads each clip to 30 s: 375 rows); the others in a prompt holding their placeholder."""
    from transformers import AutoProcessor

    from tests.support.zoo.compare import sample_audio, sampling_rate

    if model_type == "voxtral":
        pytest.importorskip("mistral_common", reason="Voxtral's tokenizer is mistral_common's (the test extra)")
    folder, manifest = zoo_folder(model_type, tmp_path)
    rate = sampling_rate(AutoProcessor.from_pretrained(folder))
    clips = sample_audio(rate)
    want = zoo_reference(folder, manifest, "audio", clips)
    # a probe at most every 0.25 s: the /health answers below come from probes run after the requests
    with ServerProcess("--model", str(folder), "--preprocess-workers", workers,
                       "--health-probe-interval-s", "0.25") as server:
        info = httpx.get(server.url + "/server_info").json()
        responses = [httpx.post(server.url + "/encode", timeout=120, json={
            "req_id": f"r{index}", "modality": "audio", "return_embedding": True, "mm_items": items})
            for index, items in enumerate([[wav_b64(clip, rate)] for clip in clips]
                                          + [[wav_b64(clip, rate) for clip in clips]])]
        health = []
        for _ in range(3):
            time.sleep(0.3)
            health.append(httpx.get(server.url + "/health", timeout=10))
        log = server.log()
    assert info["model"]["family"] == model_type and info["model"]["modalities"] == ["audio"]
    assert [(r.status_code, r.json()) for r in health] == [(200, {"status": "ok"})] * 3, log[-3000:]
    assert "health probe failed" not in log, log[-3000:]
    for response in responses:
        assert response.status_code == 200, response.text
    got = [decode_embedding(response.json()) for response in responses]
    for rows, reference in zip(got, want + [torch.cat(want)], strict=True):
        assert rows.shape == tuple(reference.shape)
        assert rel_diff(rows, reference) <= 1e-5


@pytest.fixture(scope="module")
def hunyuan_vl(tmp_path_factory) -> tuple[Path, dict]:
    return zoo_folder("hunyuan_vl", tmp_path_factory.mktemp("zoo"))


def test_hunyuan_vl_is_served_with_its_framed_placeholder_exactly(hunyuan_vl):
    """A folder without a chat template: the processor refuses the bare token, so the probe takes the form its
    error names."""
    from tests.support.zoo.compare import sample_images

    folder, manifest = hunyuan_vl
    images = sample_images()
    want = zoo_reference(folder, manifest, "image", images)
    adapter = load_checkpoint(folder, CPU, F32)
    assert isinstance(adapter, GenericAdapter)
    assert adapter.processor.prompts["image"] == "<|image_start|><|image|><|image_end|>"
    assert adapter.info.placeholder_tokens == {"image": ["<|image|>"]}
    fused = adapter.forward(adapter.processor.preprocess("image", images))
    assert [adapter.processor.item_layout("image",
                                          image).tokens for image in images] == [rows.shape[0] for rows in want]
    assert rel_diff(fused, torch.cat(want)) <= 1e-5


def test_a_chat_template_comes_first_then_the_bare_and_the_framed_placeholder(hunyuan_vl):
    """A folder that ships a chat template (as published ones do) is probed first in the template's rendering of
    an image turn; the framed form comes after the bare token, so processors that take a bare one keep it."""
    from transformers import AutoProcessor

    from encode_server.models.generic.probes import placeholder_prompts
    from processors.chat_request import CHAT_REQUEST

    processor = AutoProcessor.from_pretrained(hunyuan_vl[0])
    framed = "<|image_start|><|image|><|image_end|>"
    assert placeholder_prompts(processor, "image") == ["<|image|>", framed, "", CHAT_REQUEST]
    processor.chat_template = ("{% for message in messages %}{% for part in message['content'] %}"
                               "{% if part['type'] == 'image' %}describe " + framed + "{% endif %}{% endfor %}"
                               "{% endfor %}")
    assert placeholder_prompts(processor, "image") == ["describe " + framed, "<|image|>", framed, "", CHAT_REQUEST]
