"""The prefill side's count: an item's rows equal the placeholder tokens the family's FULL processor
(`AutoProcessor.from_pretrained(folder)`, tokenizer included) inserts into `input_ids` for it.

That is the number the prefill node splices rows into. The full processors of qwen2_5_vl and
internvl hold a video processor that needs torchvision, absent here, so their counts (and the
processor configs they saved) were recorded by `tools/reference/reference_prefill_counts.py` in
`tests/data/prefill_reference.json`; qwen2_audio's full processor runs here, live. (qwen2_vl's
count is in tests/models/test_qwen2_vl.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.models.registry import load_checkpoint
from tests.support.checkpoints.internvl import internvl_checkpoint
from tests.support.checkpoints.qwen2_audio import qwen2_audio_checkpoint, qwen2_audio_full_processor
from tests.support.checkpoints.qwen_vl import qwen25_vl_checkpoint
from tests.support.tiny_parts import install_reference_processor

pytestmark = pytest.mark.quick

CPU, F32 = torch.device("cpu"), torch.float32


def random_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("family,build", [("qwen2_5_vl", qwen25_vl_checkpoint), ("internvl", internvl_checkpoint)])
def test_rows_equal_the_recorded_full_processor_counts(tmp_path, family, build):
    _, _, folder = build(tmp_path / family)
    reference = install_reference_processor(folder, family)
    assert list(reference["files"]) == ["processor_config.json"]  # the full processor nests its parts
    adapter = load_checkpoint(folder, CPU, F32)
    assert adapter.info.family == family
    images = [random_image(w, h, i) for i, (w, h, _) in enumerate(reference["images"])]
    counts = [count for *_, count in reference["images"]]
    assert [adapter.processor.item_layout("image", image).tokens for image in images] == counts
    batch = adapter.processor.preprocess("image", images)
    assert [layout.tokens for layout in batch.layouts] == counts
    assert adapter.forward(batch).shape[0] == sum(counts)
    assert len(set(counts)) > 2, "the items should differ in size"
    for frames, width, height, count in reference["videos"]:
        clip = [random_image(width, height, f) for f in range(frames)]
        assert adapter.processor.item_layout("video", clip).tokens == count, (frames, width, height)
        batch = adapter.processor.preprocess("video", [clip])
        assert batch.layouts[0].tokens == count and adapter.forward(batch).shape[0] == count


def test_qwen2_audio_rows_equal_the_audio_tokens_its_processor_inserts(tmp_path):
    from transformers import AutoProcessor

    _, extractor, folder = qwen2_audio_checkpoint(tmp_path / "qwen2_audio")
    qwen2_audio_full_processor(extractor).save_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    assert type(processor).__name__ == "Qwen2AudioProcessor"
    adapter = load_checkpoint(folder, CPU, F32)
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (400, 8000, 2501, 40000, 48000)]
    counts = []
    for wave in waves:
        out = processor(text="describe <|audio_bos|><|AUDIO|><|audio_eos|> please", audio=[wave],
                        sampling_rate=extractor.sampling_rate, return_tensors="pt")
        counts.append(int((out["input_ids"] == processor.audio_token_id).sum()))
    assert [adapter.processor.item_layout("audio", wave).tokens for wave in waves] == counts
    batch = adapter.processor.preprocess("audio", waves)
    assert [layout.tokens for layout in batch.layouts] == counts
    assert adapter.forward(batch).shape[0] == sum(counts)
    assert len(set(counts)) == len(counts)

