"""Molmo2 through the generic path: the model adds its pooled image features onto the placeholder token's own
text embedding, so the rows served are that embedding row (read from the checkpoint, the one slice of the table
the server holds) plus the features: what Molmo2's forward hands its language model at each `<im_patch>`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from encode_server.models.generic.language_model_trap import build_on_meta, embedding_rows
from encode_server.models.loading.checkpoint import CheckpointError


def tiny_molmo2():
    from transformers import Molmo2Config, Molmo2ForConditionalGeneration

    config = Molmo2Config(text_config={"vocab_size": 40, "additional_vocab_size": 8, "hidden_size": 16,
                                       "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 2})
    return build_on_meta(Molmo2ForConditionalGeneration, config, torch.float32)


@pytest.mark.quick
def test_rows_come_from_the_part_of_a_split_table_that_holds_them(tmp_path):
    """The published layout stores the table as `wte.embedding` and `wte.new_embedding`, concatenated on load
    (`transformers`' conversion mapping): each token's row is read from the part that holds it."""
    model = tiny_molmo2()
    base, extra = torch.randn(40, 16), torch.randn(8, 16)
    save_file({"model.transformer.wte.embedding": base, "model.transformer.wte.new_embedding": extra},
              str(tmp_path / "model.safetensors"))
    key = "model.language_model.embed_tokens.weight"
    rows = embedding_rows(tmp_path, model, key, [3, 41, 47])
    assert set(rows) == {3, 41, 47}
    assert torch.equal(rows[3], base[3]) and torch.equal(rows[41], extra[1]) and torch.equal(rows[47], extra[7])
    with pytest.raises(CheckpointError, match=r"no rows for tokens \[48\]"):
        embedding_rows(tmp_path, model, key, [48])


@pytest.mark.quick
def test_a_table_stored_whole_is_read_by_its_own_key(tmp_path):
    table = torch.randn(48, 16)
    save_file({"model.language_model.embed_tokens.weight": table}, str(tmp_path / "model.safetensors"))
    rows = embedding_rows(tmp_path, tiny_molmo2(), "model.language_model.embed_tokens.weight", [45])
    assert torch.equal(rows[45], table[45])
    (tmp_path / "model.safetensors").unlink()
    save_file({"something.else": table}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="holds no model.language_model.embed_tokens.weight"):
        embedding_rows(tmp_path, tiny_molmo2(), "model.language_model.embed_tokens.weight", [45])


@pytest.mark.slow  # builds a tiny Molmo2 checkpoint and runs the full model beside the server's (~10 s of CPU)
def test_images_and_videos_equal_what_the_full_model_hands_its_language_model(tmp_path):
    """From a tiny checkpoint saved with `save_pretrained` (the zoo's): per item and fused, the rows equal the
    language model's inputs at the `<im_patch>` positions of Molmo2's own forward."""
    from tests.support.zoo.compare import run_type

    results = {row["modality"]: row for row in run_type("molmo2", tmp_path)}
    assert results["image"]["result"] == "exact", results["image"]
    assert results["video"]["result"] == "exact", results["video"]
