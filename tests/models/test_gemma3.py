"""Gemma 3 from a tiny full checkpoint: rows equal `get_image_features` and fill exactly the image tokens the
full processor inserts, pan-and-scan crops included when the processor is asked for them."""

from __future__ import annotations

import json

import pytest
import torch

from encode_server.models.families.gemma3 import FAMILY, gemma3_from_folder
from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type
from tests.support.checkpoints.gemma3 import gemma3_checkpoint
from tests.support.family_fixtures import spliced_rows
from tests.support.helpers import rel_diff
from tests.support.tiny_parts import random_image

pytestmark = pytest.mark.quick

CPU, F32 = torch.device("cpu"), torch.float32
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
SIZES = [(130, 40), (50, 50), (40, 170), (60, 45)]  # with pan-and-scan: 3, 0, 4 (the cap) and 2 crops


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint[1])


def images():
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]


def reference_rows(model, processor, image, **kwargs) -> torch.Tensor:
    pixels = processor(images=[image], return_tensors="pt", **kwargs)["pixel_values"]
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixels).pooler_output
    return out.reshape(-1, out.shape[-1])


def test_registry_routes_gemma3_here():
    assert family_for_model_type("gemma3") is FAMILY and FAMILY.shard is not None


@pytest.mark.parametrize("kwargs", [{}, PAN_AND_SCAN], ids=["default", "pan_and_scan"])
def test_fused_items_equal_get_image_features_alone(checkpoint, processor, kwargs):
    model, folder = checkpoint
    adapter = gemma3_from_folder(folder, CPU, F32, processor_kwargs=kwargs)
    items = images()
    batch = adapter.processor.preprocess("image", items)
    assert batch.layouts == [adapter.processor.item_layout("image", image) for image in items]
    fused = adapter.forward(batch)
    alone = [reference_rows(model, processor, image, **kwargs) for image in items]
    assert fused.shape[0] == sum(rows.shape[0] for rows in alone) == batch.total_tokens
    assert rel_diff(fused, torch.cat(alone)) <= 1e-5
    crops = [layout.grid_thw[0] - 1 for layout in batch.layouts]
    assert crops == ([3, 0, 4, 2] if kwargs else [0, 0, 0, 0])


@pytest.mark.parametrize("kwargs", [{}, PAN_AND_SCAN], ids=["default", "pan_and_scan"])
def test_rows_fill_exactly_the_image_tokens_the_full_processor_inserts(checkpoint, processor, kwargs):
    model, folder = checkpoint
    adapter = gemma3_from_folder(folder, CPU, F32, processor_kwargs=kwargs)
    for image in images():
        inputs = processor(text=["describe <start_of_image> image"], images=[[image]], return_tensors="pt", **kwargs)
        placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
        layout = adapter.processor.item_layout("image", image)
        rows = adapter.forward(adapter.processor.preprocess("image", [image]))
        assert layout.tokens == placeholders == rows.shape[0]
        assert rel_diff(rows, spliced_rows(model, inputs, model.config.image_token_id)) <= 1e-5


def test_pan_and_scan_in_the_image_processor_config_alone_is_not_what_the_full_processor_does(checkpoint, processor):
    """The folder's image processor says do_pan_and_scan=True; the full processor overrides it with its own
    defaults, so the prefill side inserts one image's tokens and so must we."""
    model, folder = checkpoint
    saved = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    assert saved["do_pan_and_scan"] is True
    wide = random_image(130, 40, 0)
    inputs = processor(text=["<start_of_image>"], images=[[wide]], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == 16
    assert FAMILY.load(folder, CPU, F32).processor.item_layout("image", wide).tokens == 16


def test_published_key_layout_in_shards_loads_the_same_rows_without_the_language_model(checkpoint, tmp_path):
    """Published Gemma 3 checkpoints name keys `vision_tower.vision_model.*` and `language_model.model.*` and
    come in shards; the language model's shard is never opened (here it does not even exist)."""
    from safetensors.torch import load_file, save_file

    model, folder = checkpoint
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (legacy / path.name).write_bytes(path.read_bytes())
    shards: dict[str, dict[str, torch.Tensor]] = {"vision.safetensors": {}, "projector.safetensors": {}}
    weight_map = {}
    for key, tensor in load_file(str(folder / "model.safetensors")).items():
        if key.startswith("vision_tower."):
            key, shard = "vision_tower.vision_model." + key.removeprefix("vision_tower."), "vision.safetensors"
        elif key.startswith("language_model."):
            key, shard = "language_model.model." + key.removeprefix("language_model."), "language.safetensors"
        else:
            shard = "projector.safetensors"
        weight_map[key] = shard
        shards.get(shard, {})[key] = tensor
    for name, tensors in shards.items():
        save_file(tensors, str(legacy / name), metadata={"format": "pt"})
    (legacy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert any(k.startswith("vision_tower.vision_model.encoder.") for k in weight_map)
    assert not (legacy / "language.safetensors").exists()
    image = random_image(70, 50, 5)
    rows = [adapter.forward(adapter.processor.preprocess("image", [image]))
            for adapter in (FAMILY.load(legacy, CPU, F32), FAMILY.load(folder, CPU, F32))]
    assert torch.equal(*rows)


def test_per_item_inputs_concatenate_into_one_call(checkpoint):
    adapter = FAMILY.load(checkpoint[1], CPU, F32)
    items = images()
    together = adapter.processor.preprocess("image", items)
    alone = [adapter.processor.preprocess("image", [image]) for image in items]
    assert torch.equal(torch.cat([b.inputs["pixel_values"] for b in alone]), together.inputs["pixel_values"])


def test_processor_and_model_disagreeing_on_tokens_is_refused(checkpoint, tmp_path):
    _, folder = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    settings = json.loads((broken / "processor_config.json").read_text())
    (broken / "processor_config.json").write_text(json.dumps({**settings, "image_seq_length": 25}))
    with pytest.raises(CheckpointError, match="image_seq_length=25"):
        FAMILY.load(broken, CPU, F32)
