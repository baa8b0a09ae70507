"""Checks shared by the patch-grid vision families' tests (GLM-4V, Qwen3-VL): each family's test module
builds its checkpoint folders and adapters, then runs these against `transformers` itself and the
processor reference (`tests/data/processor_reference.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support import paths
from tests.support.checkpoints.grid_vision import (
    CLIP_SIZES,
    IMAGE_SIZES,
    checkpoint_folders,
    fingerprint,
    sample_clips,
    sample_images,
)
from tests.support.helpers import rel_diff

CPU, F32 = torch.device("cpu"), torch.float32
REFERENCE = json.loads((paths.DATA / "processor_reference.json").read_text())["folders"]


def build_checkpoints(root: Path, model_types: tuple[str, ...], first_seed: int) -> dict:
    """model_type -> (the full model, {layout: checkpoint folder})."""
    return {model_type: checkpoint_folders(root, model_type, seed=first_seed + index)
            for index, model_type in enumerate(model_types)}


def load_adapters(family, checkpoints: dict) -> dict:
    """(model_type, layout) -> the family's adapter loaded from that folder."""
    return {(model_type, layout): family.load(folder, CPU, F32)
            for model_type, (_, folders) in checkpoints.items() for layout, folder in folders.items()}


def expected_rows(features) -> list[torch.Tensor]:
    """Per item: the main rows and the deepstack blocks (if any) side by side, as the family ships them."""
    deepstack = getattr(features, "deepstack_features", None) or []
    return [torch.cat([main, *(layer[index] for layer in deepstack)], dim=-1)
            for index, main in enumerate(features.pooler_output)]


def check_fused_images_equal_get_image_features_alone(model, folder: Path, adapter) -> None:
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder)
    images = sample_images()
    batch = adapter.processor.preprocess("image", images)
    pieces = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
    for image, got in zip(images, pieces, strict=True):
        inputs = processor(images=[image], return_tensors="pt")
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                      image_grid_thw=inputs["image_grid_thw"])
        want = expected_rows(features)[0]
        assert got.shape == (want.shape[0], adapter.info.row_width) == want.shape
        assert rel_diff(got, want) <= 1e-5


def check_fused_videos_equal_get_video_features_alone(model, adapter) -> None:
    clips = sample_clips()
    batch = adapter.processor.preprocess("video", clips)
    pieces = adapter.split_rows(batch.layouts, adapter.forward(batch), [1] * len(batch.layouts))
    for clip, got in zip(clips, pieces, strict=True):
        pixels, layout = adapter.processor.video.patches(clip)
        with torch.no_grad():
            features = model.model.get_video_features(pixel_values_videos=pixels,
                                                      video_grid_thw=torch.tensor([layout.grid_thw]))
        want = expected_rows(features)[0]
        assert got.shape == want.shape
        assert rel_diff(got, want) <= 1e-5


def check_rows_equal_the_full_processors_placeholder_count(adapter, reference: dict) -> None:
    for image, size, want in zip(sample_images(), IMAGE_SIZES, reference["images"], strict=True):
        assert want["size"] == list(size)
        got = adapter.processor.item_layout("image", image)
        assert (got.tokens, list(got.grid_thw)) == (want["tokens"], want["grid_thw"]), size
    for clip, size, want in zip(sample_clips(), CLIP_SIZES, reference["videos"], strict=True):
        assert [want["frames"], *want["size"]] == list(size)
        got = adapter.processor.item_layout("video", clip)
        assert (got.tokens, list(got.grid_thw)) == (want["tokens"], want["grid_thw"]), size


def check_video_pixels_equal_transformers_video_processor(adapter, reference: dict, expected_class: str) -> None:
    """Bit for bit: same resize kernel, same fused normalisation, same patch order."""
    assert reference["video_processor"] == expected_class == type(adapter.processor.video.processor).__name__
    for clip, want in zip(sample_clips(), reference["videos"], strict=True):
        pixels, clip_layout = adapter.processor.video.patches(clip)
        assert list(clip_layout.grid_thw) == want["grid_thw"]
        assert fingerprint(pixels) == want["pixels"]
