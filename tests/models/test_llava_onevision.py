"""LLaVA-OneVision from a tiny full checkpoint: anyres rows (base tile, unpadded map, newline rows) equal
`get_image_features`, fused or alone, and fill exactly the image tokens the full processor inserts."""

from __future__ import annotations

import json

import pytest
import torch

from encode_server.models.families.llava_onevision import FAMILY
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.llava_onevision import llava_onevision_checkpoint, llava_onevision_processor
from tests.support.family_fixtures import spliced_rows
from tests.support.helpers import rel_diff
from tests.support.tiny_parts import random_image

CPU, F32 = torch.device("cpu"), torch.float32
# Square (2x2 tiles), wide (unpadded rows), tall past anyres_max_2 (shrunk), thin, large (3x3 tiles, shrunk).
SIZES = [(30, 30), (100, 40), (40, 170), (13, 200), (300, 290)]


@pytest.fixture(scope="module", params=[("siglip_vision_model", "full"), ("clip_vision_model", "default")],
                ids=["siglip-full", "clip-default"])
def checkpoint(request, tmp_path_factory):
    tower, strategy = request.param
    model, folder = llava_onevision_checkpoint(tmp_path_factory.mktemp("onevision"), tower, strategy)
    return model, folder, llava_onevision_processor(folder), FAMILY.load(folder, CPU, F32)


def images():
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]


def test_registry_routes_llava_onevision_here():
    assert family_for_model_type("llava_onevision") is FAMILY and FAMILY.modalities == ("image",)


def test_fused_items_equal_get_image_features_alone(checkpoint):
    model, _, processor, adapter = checkpoint
    items = images()
    batch = adapter.processor.preprocess("image", items)
    assert batch.layouts == [adapter.processor.item_layout("image", image) for image in items]
    fused = adapter.forward(batch)
    alone = []
    for image in items:
        inputs = processor.image_processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                 image_sizes=inputs["image_sizes"]).pooler_output
        alone.append(torch.cat(out))
    assert [layout.tokens for layout in batch.layouts] == [rows.shape[0] for rows in alone]
    assert len({layout.tokens for layout in batch.layouts}) > 2, "sizes should give different row counts"
    assert rel_diff(fused, torch.cat(alone)) <= 1e-5


def test_rows_fill_exactly_the_image_tokens_the_full_processor_inserts(checkpoint):
    model, _, processor, adapter = checkpoint
    for image in images():
        inputs = processor(text=["describe <image>"], images=[image], return_tensors="pt")
        placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
        rows = adapter.forward(adapter.processor.preprocess("image", [image]))
        assert adapter.processor.item_layout("image", image).tokens == placeholders == rows.shape[0]
        assert placeholders == processor._get_num_multimodal_tokens(image_sizes=[image.size[::-1]])[
            "num_image_tokens"][0]
        assert rel_diff(rows, spliced_rows(model, inputs, model.config.image_token_id)) <= 1e-5


def test_per_item_inputs_concatenate_into_one_call(checkpoint):
    adapter = checkpoint[3]
    items = images()
    together = adapter.processor.preprocess("image", items)
    alone = [adapter.processor.preprocess("image", [image]) for image in items]
    for key in together.inputs:
        assert torch.equal(torch.cat([batch.inputs[key] for batch in alone]), together.inputs[key]), key
    assert together.inputs["pixel_values"].shape[0] == sum(layout.grid_thw[0] for layout in together.layouts)


def test_a_folder_without_num_image_tokens_counts_as_the_tower_says(checkpoint, tmp_path):
    model, folder, processor, adapter = checkpoint
    silent = tmp_path / "silent"
    silent.mkdir()
    for path in folder.iterdir():
        (silent / path.name).write_bytes(path.read_bytes())
    settings = json.loads((silent / "processor_config.json").read_text())
    (silent / "processor_config.json").write_text(json.dumps({**settings, "num_image_tokens": None}))
    derived = FAMILY.load(silent, CPU, F32)
    assert [derived.processor.item_layout("image", image) for image in images()] == \
        [adapter.processor.item_layout("image", image) for image in images()]


def test_processor_settings_that_disagree_with_the_model_are_refused(checkpoint, tmp_path):
    folder = checkpoint[1]
    for name, change, message in [
        ("processor_config.json", {"vision_aspect_ratio": "anyres_max_9"}, "vision_aspect_ratio"),
        ("preprocessor_config.json", {"image_grid_pinpoints": [[28, 28]]}, "image_grid_pinpoints"),
    ]:
        broken = tmp_path / f"broken-{message}"
        broken.mkdir()
        for path in folder.iterdir():
            (broken / path.name).write_bytes(path.read_bytes())
        settings = json.loads((broken / name).read_text())
        (broken / name).write_text(json.dumps({**settings, **change}))
        with pytest.raises(CheckpointError, match=message):
            FAMILY.load(broken, CPU, F32)
