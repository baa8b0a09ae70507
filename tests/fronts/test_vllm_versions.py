"""vLLM 0.32 and 0.33, chosen by `--ec-vllm-version`: the image each decodes differently (an RGB PNG with a tRNS
chunk) gives each version's own pixels, `io_config` and identifiers, as vLLM itself computed them
(`tests/golden/vllm-versions.json`, written by `tools/reference/vllm_golden.py versions` in each version's side
venv); the answer's `ec_transfer_params` as each version writes them; a consumer's leftover empty folder never
blocks a write; a version this producer does not speak is refused at start-up."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from encode_server.fronts.vllm.connectors.base import ItemRows, transfer_params
from encode_server.fronts.vllm.connectors.example import FILE_NAME, SharedStorage
from encode_server.fronts.vllm.identifiers import EncodedImage, image_identifier
from encode_server.fronts.vllm.images import decode_vllm_image
from encode_server.fronts.vllm.versions import VllmVersion, parse_vllm_version
from encode_server.ops.settings import load_settings
from encode_server.runtime import StartError, fronts_for
from tests.support import paths

pytestmark = pytest.mark.quick

REFERENCE = json.loads((paths.GOLDEN / "vllm-versions.json").read_text())


@pytest.mark.parametrize("version", sorted(REFERENCE))
def test_each_version_decodes_and_identifies_as_that_vllm_does(version):
    assert {"0.32.0", "0.33.0"} <= set(REFERENCE)
    reference = REFERENCE[version]
    for name, expected in reference["images"].items():
        data = (paths.GOLDEN / "vllm-images-versions" / name).read_bytes()
        decoded = decode_vllm_image(data, 10**8, "item", parse_vllm_version(version).composites_rgb_transparency)
        pixels = np.ascontiguousarray(np.asarray(decoded.image))
        assert hashlib.sha256(pixels.tobytes()).hexdigest() == expected["pixels_sha256"], (version, name)
        io_config = decoded.io_config and {key: list(value) if isinstance(value, tuple) else value
                                           for key, value in decoded.io_config.items()}
        assert io_config == expected["io_config"]
        # The encoder is given the pixels alone (a processor that reads a tRNS entry would composite them).
        assert "transparency" not in decoded.image.info and "transparency" not in Image.open(
            io.BytesIO(decoded.file_bytes(data))).info
        for algorithm, by_model in expected["identifiers"].items():
            for model_id, identifier in by_model.items():
                assert image_identifier(algorithm, model_id, EncodedImage(data, decoded.io_config)) == identifier


def test_the_versions_name_the_same_trns_png_differently():
    [name] = REFERENCE["0.32.0"]["images"]
    ids = {version: REFERENCE[version]["images"][name]["identifiers"]["blake3"] for version in ("0.32.0", "0.33.0")}
    assert ids["0.32.0"] != ids["0.33.0"]


def test_the_answer_names_the_modality_from_0_33():
    items = [ItemRows("a", "image", torch.zeros(2, 4)), ItemRows("b", "audio", torch.zeros(3, 4)),
             ItemRows("a", "image", torch.zeros(2, 4))]
    assert transfer_params(items, "test", VllmVersion("0.33.0")) == {
        "a": {"modality": "image", "item_indices": [0, 2], "metadata": {}},
        "b": {"modality": "audio", "item_indices": [1], "metadata": {}}}
    assert transfer_params(items, "test", VllmVersion("0.32.0")) == {
        "a": {"item_indices": [0, 2], "metadata": {}}, "b": {"item_indices": [1], "metadata": {}}}


def test_a_consumers_empty_folder_is_a_miss_and_written_into(tmp_path):
    (tmp_path / "looked-up").mkdir()  # a vLLM 0.32 consumer's has_cache_item on a miss leaves this
    storage = SharedStorage(tmp_path, fsync=False)
    assert storage.files == 0 and not storage.lookup("looked-up")
    storage.write("looked-up", torch.ones(3, 4))
    assert (tmp_path / "looked-up" / FILE_NAME).is_file() and storage.lookup("looked-up")
    assert storage.stored_rows("looked-up") == 3


def test_one_setting_names_the_consumers_version():
    assert parse_vllm_version("0.32.1").minor == "0.32" and not parse_vllm_version("0.32.0").names_item_modality
    assert parse_vllm_version("0.33.0+cpu").composites_rgb_transparency
    for text in ("0.31.0", "1.0.0", "latest", ""):
        with pytest.raises(ValueError, match="0.32 and 0.33"):
            parse_vllm_version(text)
    with pytest.raises(StartError, match="--ec-vllm-version"):  # before the model loads
        fronts_for(load_settings(["--ec-storage", "/tmp/ec", "--ec-vllm-version", "0.31.0"]))
