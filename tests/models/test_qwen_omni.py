"""Qwen2.5-Omni and Qwen3-Omni from real checkpoint folders, against `transformers` itself.

1. Parity: every item's rows equal what the thinker's own `get_image_features` / `get_video_features`
   (deepstack blocks included) / `get_audio_features` give for that item alone, fed by the model's full
   processor, also when items of different sizes are fused into one `preprocess` + `forward`.
2. The prefill side's count: an item's rows equal the placeholder tokens the full processor
   (`AutoProcessor.from_pretrained(folder)`) puts into `input_ids` for it, and an audio item's `mel_frames`
   equal its `feature_attention_mask` (what SGLang's `get_mm_data` turns into the count).
3. Splicing: in one prompt with an image, a video and a clip, the thinker's forward puts exactly these rows
   at the placeholder positions it hands its language model.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from encode_server.models.loading.checkpoint import CheckpointError
from encode_server.models.registry import family_for_model_type, load_checkpoint
from processors.base import ItemError
from tests.support.checkpoints.qwen_omni import (
    TOKENS,
    audio_clip,
    checkpoint,
    sample_audio,
    sample_clips,
    sample_images,
    token_ids,
)
from tests.support.helpers import rel_diff

CPU, F32 = torch.device("cpu"), torch.float32
MODEL_TYPES = ("qwen2_5_omni", "qwen3_omni_moe")
SEEDS = {"qwen2_5_omni": 31, "qwen3_omni_moe": 32}
PLACEHOLDER = {"image": "image_token", "video": "video_token", "audio": "audio_token"}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni")
    return {model_type: checkpoint(root, model_type, SEEDS[model_type]) for model_type in MODEL_TYPES}


@pytest.fixture(scope="module")
def adapters(checkpoints):
    return {(model_type, layout): load_checkpoint(folder, CPU, F32)
            for model_type, (_, folders) in checkpoints.items() for layout, folder in folders.items()}


@pytest.fixture(scope="module")
def processors(checkpoints):
    from transformers import AutoProcessor

    return {(model_type, layout): AutoProcessor.from_pretrained(folder)
            for model_type, (_, folders) in checkpoints.items() for layout, folder in folders.items()}


def items_of(modality: str, model_type: str) -> list:
    return {"image": sample_images, "video": sample_clips}[modality]() if modality != "audio" \
        else sample_audio(model_type)


def alone(processor, model_type: str, modality: str, item):
    """The full processor's inputs for a prompt holding this one item."""
    tokens = TOKENS[model_type]
    text = f"describe {tokens[PLACEHOLDER[modality]]} please"
    key = {"image": "images", "video": "videos", "audio": "audio"}[modality]
    return processor(text=[text], return_tensors="pt", **{key: [item]})


def thinker_rows(model, modality: str, inputs) -> torch.Tensor:
    """What the thinker's own feature function gives for these inputs: `[main] + deepstack` side by side."""
    thinker = model.thinker.model
    with torch.no_grad():
        if modality == "audio":
            out = thinker.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"])
            return out.last_hidden_state
        if modality == "image":
            out = thinker.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        else:
            out = thinker.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
    deepstack = [blocks[0] for blocks in (getattr(out, "deepstack_features", None) or [])]
    return torch.cat([out.pooler_output[0], *deepstack], dim=-1)


def test_the_registry_serves_both_model_types_with_their_modules():
    for model_type in MODEL_TYPES:
        family = family_for_model_type(model_type)
        assert family is not None and family.name == model_type and family.modalities == ("image", "video", "audio")


@pytest.mark.parametrize("modality", ["image", "video", "audio"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_items_equal_the_thinkers_features_alone_and_the_processors_count(checkpoints, adapters, processors,
                                                                               model_type, modality):
    model, _ = checkpoints[model_type]
    adapter, processor = adapters[model_type, "nested"], processors[model_type, "nested"]
    items = items_of(modality, model_type)
    prepared = adapter.processor.preprocess(modality, items)
    assert prepared.layouts == [adapter.processor.item_layout(modality, item) for item in items]
    rows = adapter.forward(prepared)
    pieces = adapter.split_rows(prepared.layouts, rows, [1] * len(items))
    placeholder = token_ids(model_type)[PLACEHOLDER[modality]]
    for index, (item, layout, got) in enumerate(zip(items, prepared.layouts, pieces)):
        inputs = alone(processor, model_type, modality, item)
        want = thinker_rows(model, modality, inputs)
        assert got.shape == want.shape == (layout.tokens, adapter.info.row_width_of(modality)), index
        assert rel_diff(got, want) <= TOLERANCE, (modality, index)
        assert int((inputs["input_ids"] == placeholder).sum()) == layout.tokens, (modality, index)
        if modality == "audio":
            assert layout.mel_frames == int(inputs["feature_attention_mask"].sum())
        else:
            grid = inputs["image_grid_thw" if modality == "image" else "video_grid_thw"][0].tolist()
            assert list(layout.grid_thw) == grid


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_published_flat_layout_gives_the_same_rows_and_counts(checkpoints, adapters, processors, model_type):
    nested, flat = adapters[model_type, "nested"], adapters[model_type, "flat"]
    processor = processors[model_type, "flat"]
    for modality in ("image", "video", "audio"):
        items = items_of(modality, model_type)[:2]
        prepared = flat.processor.preprocess(modality, items)
        assert torch.equal(flat.forward(prepared), nested.forward(nested.processor.preprocess(modality, items)))
        placeholder = token_ids(model_type)[PLACEHOLDER[modality]]
        for item, layout in zip(items, prepared.layouts):
            inputs = alone(processor, model_type, modality, item)
            assert int((inputs["input_ids"] == placeholder).sum()) == layout.tokens


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_thinker_splices_these_rows_at_its_placeholders(checkpoints, adapters, processors, model_type):
    model, _ = checkpoints[model_type]
    adapter, processor = adapters[model_type, "nested"], processors[model_type, "nested"]
    tokens, ids = TOKENS[model_type], token_ids(model_type)
    image, clip, audio = sample_images()[1], sample_clips()[0], sample_audio(model_type)[2]
    text = (f"describe {tokens['vision_bos_token']}{tokens['image_token']}{tokens['vision_eos_token']} and "
            f"{tokens['vision_bos_token']}{tokens['video_token']}{tokens['vision_eos_token']} and "
            f"{tokens['audio_bos_token']}{tokens['audio_token']}{tokens['audio_eos_token']} please")
    inputs = processor(text=[text], images=[image], videos=[clip], audio=[audio], return_tensors="pt")
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"][0]

    handle = model.thinker.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model.thinker(**inputs)
    finally:
        handle.remove()
    input_ids = inputs["input_ids"][0]
    width = adapter.info.hidden_size
    for modality, item in (("image", image), ("video", clip), ("audio", audio)):
        ours = adapter.forward(adapter.processor.preprocess(modality, [item]))[:,
                                                                               :width]  # deepstack goes to later layers
        spliced = captured["embeds"][input_ids == ids[PLACEHOLDER[modality]]]
        assert spliced.shape == ours.shape, modality
        assert rel_diff(ours, spliced) <= TOLERANCE, modality


def test_qwen3_omni_short_clips_go_through_the_tower_apart(adapters):
    """A clip shorter than one 100-frame chunk, fused with longer ones in one tower call, would be padded and
    get other rows; the adapter gives it the rows it has alone (the test's tiny model has conv biases)."""
    from processors.families.qwen_omni import Qwen3OmniAudioRule

    adapter = adapters["qwen3_omni_moe", "nested"]
    clips = [audio_clip(8000, 1), audio_clip(37_937, 2)]  # 50 frames; 379 frames
    prepared = adapter.processor.preprocess("audio", clips)
    assert adapter.processor.audio.rule.tower_groups([30, 379, 30, 100, 50]) == [[0, 2], [1, 3], [4]]
    apart = adapter.forward(prepared)
    short = prepared.layouts[0].tokens
    assert torch.equal(apart[:short], adapter.forward(adapter.processor.preprocess("audio", clips[:1])))

    class OneCall(Qwen3OmniAudioRule):
        def tower_groups(self, frames):
            return [list(range(len(frames)))]

    rule, adapter.processor.audio.rule = adapter.processor.audio.rule, OneCall()
    try:
        together = adapter.forward(prepared)
    finally:
        adapter.processor.audio.rule = rule
    assert rel_diff(together[:short], apart[:short]) > 10 * TOLERANCE  # the grouping is what keeps them exact


def test_audio_the_model_cannot_take_is_an_item_error(adapters):
    qwen25, qwen3 = adapters["qwen2_5_omni", "nested"], adapters["qwen3_omni_moe", "nested"]
    with pytest.raises(ItemError, match="longer than the model's window of 4 s"):
        qwen25.processor.item_layout("audio", np.zeros(64_001, dtype=np.float32))
    qwen3.processor.item_layout("audio", np.zeros(64_001, dtype=np.float32))  # Qwen3-Omni's processor has no window
    for adapter, samples in ((qwen25, 320), (qwen3, 200)):
        with pytest.raises(ItemError, match="too short"):
            adapter.processor.item_layout("audio", np.zeros(samples, dtype=np.float32))
        with pytest.raises(ItemError, match="mono waveform"):
            adapter.processor.item_layout("audio", np.zeros((2, 16000), dtype=np.float32))
    assert qwen25.processor.item_layout("audio", np.zeros(321, dtype=np.float32)).tokens == 1
    assert qwen3.processor.item_layout("audio", np.zeros(201, dtype=np.float32)).tokens == 1


def copy_folder(source, target):
    shutil.copytree(source, target)
    return target


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_folders_the_family_cannot_serve_exactly_are_refused(checkpoints, tmp_path):
    _, folders = checkpoints["qwen3_omni_moe"]
    window = copy_folder(folders["nested"], tmp_path / "window")
    edit_json(window / "config.json", lambda c: c["thinker_config"]["audio_config"].update(n_window=25))
    with pytest.raises(CheckpointError, match="n_window is 25"):
        load_checkpoint(window, CPU, F32)

    rate = copy_folder(folders["flat"], tmp_path / "rate")
    edit_json(rate / "preprocessor_config.json", lambda c: c.update(sampling_rate=44100))
    with pytest.raises(CheckpointError, match="sampling rate"):
        load_checkpoint(rate, CPU, F32)

    from safetensors.torch import load_file, save_file

    partial = copy_folder(checkpoints["qwen2_5_omni"][1]["nested"], tmp_path / "partial")
    tensors = load_file(str(partial / "model.safetensors"))
    save_file({key: value for key, value in tensors.items() if ".audio_tower.layers.1." not in key},
              str(partial / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks .* encoder tensors: audio_tower.layers.1"):
        load_checkpoint(partial, CPU, F32)


def test_only_the_thinkers_towers_are_built(adapters):
    for model_type in MODEL_TYPES:
        adapter = adapters[model_type, "nested"]
        assert set(adapter.encoder) == {"visual", "audio_tower"}
        names = {name.split(".")[0] for name, _ in adapter.encoder.named_parameters()}
        assert names == {"visual", "audio_tower"}


@pytest.mark.parametrize("name", ["tiny-qwen2.5-omni", "tiny-qwen3-omni"])
def test_builtins_serve_all_three_modalities_and_pickle_for_workers(name):
    import pickle

    from encode_server.models.registry import builtin_models

    adapter = builtin_models()[name](CPU, F32)
    deepstack = 2 if name == "tiny-qwen3-omni" else 0
    assert adapter.info.deepstack == deepstack and adapter.info.deepstack_of("audio") == 0
    assert adapter.processor.sampling_rate == 16000 and adapter.packed_attention and adapter.packed_audio_attention
    adapter.warmup()
    items = {"image": sample_images()[:2], "video": sample_clips()[:1], "audio": sample_audio("qwen3_omni_moe")[2:4]}
    copy = pickle.loads(pickle.dumps(adapter.processor))
    for modality, batch in items.items():
        prepared = adapter.processor.preprocess(modality, batch)
        rows = adapter.forward(prepared)
        assert rows.shape == (prepared.total_tokens, adapter.info.row_width_of(modality))
        from_copy = copy.preprocess(modality, batch)
        assert from_copy.layouts == prepared.layouts
        assert all(torch.equal(from_copy.inputs[key], prepared.inputs[key]) for key in prepared.inputs)
