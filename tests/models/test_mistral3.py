"""Mistral 3 from a tiny full checkpoint: one row per `[IMG]` token, equal to `get_image_features` whether
items are fused (padded to the largest) or alone, and spliced by the model exactly where the full
`PixtralProcessor` puts its `[IMG]` tokens (the `[IMG_BREAK]`/`[IMG_END]` tokens get no rows)."""

from __future__ import annotations

import json

import pytest
import torch

import encode_server.models.families.mistral3 as mistral3
from encode_server.models.families.mistral3 import FAMILY
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.mistral3 import mistral3_checkpoint, pixtral_processor_outputs
from tests.support.family_fixtures import spliced_rows
from tests.support.helpers import rel_diff
from tests.support.tiny_parts import random_image

CPU, F32 = torch.device("cpu"), torch.float32
SIZES = [(100, 40), (30, 30), (40, 170), (13, 200), (300, 290)]  # every one a different merged grid


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, folder = mistral3_checkpoint(tmp_path_factory.mktemp("mistral3"))
    return model, folder, FAMILY.load(folder, CPU, F32)


def images():
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]


def test_registry_routes_mistral3_here():
    assert family_for_model_type("mistral3") is FAMILY and FAMILY.shard is not None


def test_fused_padded_items_equal_get_image_features_alone(checkpoint):
    model, _, adapter = checkpoint
    items = images()
    batch = adapter.processor.preprocess("image", items)
    assert batch.inputs["pixel_values"].shape[-2:] == (84, 84), "the batch is padded to its largest image"
    assert batch.layouts == [adapter.processor.item_layout("image", image) for image in items]
    fused = adapter.forward(batch)
    alone = []
    for image in items:
        one = adapter.processor.preprocess("image", [image])
        with torch.no_grad():
            out = model.model.get_image_features(pixel_values=one.inputs["pixel_values"],
                                                 image_sizes=one.inputs["image_sizes"]).pooler_output
        alone.append(torch.cat(out))
    assert [layout.tokens for layout in batch.layouts] == [rows.shape[0] for rows in alone] == [18, 9, 12, 6, 36]
    assert rel_diff(fused, torch.cat(alone)) <= 1e-5


def test_collate_of_per_item_inputs_equals_one_processor_call(checkpoint):
    adapter = checkpoint[2]
    items = images()
    together = adapter.processor.preprocess("image", items)
    collated = adapter.processor.collate([adapter.processor.preprocess("image", [image]) for image in items])
    assert collated.layouts == together.layouts
    for key in together.inputs:
        assert torch.equal(collated.inputs[key], together.inputs[key]), key
    assert torch.equal(adapter.forward(collated), adapter.forward(together))


def test_one_row_per_img_token_of_the_full_processor_and_spliced_there(checkpoint, tmp_path):
    model, folder, adapter = checkpoint
    items = images()
    image_token = model.config.image_token_id
    break_token, end_token = (adapter_vocab(folder)[t] for t in ("[IMG_BREAK]", "[IMG_END]"))
    for image, inputs in zip(items, pixtral_processor_outputs(folder, items, tmp_path / "pixtral")):
        layout = adapter.processor.item_layout("image", image)
        _, rows_h, cols_w = layout.grid_thw
        ids = inputs["input_ids"][0]
        assert int((ids == image_token).sum()) == layout.tokens == rows_h * cols_w
        assert int((ids == break_token).sum()) == rows_h - 1 and int((ids == end_token).sum()) == 1
        rows = adapter.forward(adapter.processor.preprocess("image", [image]))
        assert rows.shape[0] == layout.tokens
        assert rel_diff(rows, spliced_rows(model, inputs, image_token)) <= 1e-5


def adapter_vocab(folder) -> dict[str, int]:
    return json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]


def test_forward_groups_bound_the_attention_mask_without_changing_rows(checkpoint, monkeypatch):
    adapter = checkpoint[2]
    batch = adapter.processor.preprocess("image", images())
    whole = adapter.forward(batch)
    monkeypatch.setattr(mistral3, "MAX_PATCHES_PER_FORWARD", 100)  # 144 patches for the largest image alone
    assert len(adapter.groups(batch.inputs["image_sizes"].tolist())) > 2
    assert rel_diff(adapter.forward(batch), whole) <= 1e-5


def test_processor_patch_that_disagrees_with_the_model_is_refused(checkpoint, tmp_path):
    folder = checkpoint[1]
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor"}))
    with pytest.raises(CheckpointError, match="16 x 1"):  # PixtralProcessor's defaults, not the model's 7 x 2
        FAMILY.load(broken, CPU, F32)


def test_bfloat16_rows_are_bit_identical_to_from_pretrained_in_bfloat16(checkpoint):
    """Built in the target dtype like `from_pretrained(dtype=...)`: rotary frequencies stay float32."""
    from transformers import Mistral3ForConditionalGeneration

    folder = checkpoint[1]
    adapter = FAMILY.load(folder, CPU, torch.bfloat16)
    reference = Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    batch = adapter.processor.preprocess("image", images()[:3])
    with torch.no_grad():
        want = reference.model.get_image_features(pixel_values=batch.inputs["pixel_values"].to(torch.bfloat16),
                                                  image_sizes=batch.inputs["image_sizes"]).pooler_output
    got = adapter.forward(batch)
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.cat(want))
