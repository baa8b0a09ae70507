"""Tiny full checkpoints (language model included) saved with `save_pretrained`, for parity tests.

Their sizes and processor settings differ from the built-ins on purpose, so the loader has to read
everything from the folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _save(model: torch.nn.Module, processor, folder: Path, max_shard_size: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    processor.save_pretrained(folder)
    return folder


def qwen25_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=3, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=96,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[2]),
    )
    torch.manual_seed(7)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    return model, processor, _save(model, processor, folder, max_shard_size)


def internvl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    config = InternVLConfig(
        vision_config=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
                           image_size=[42, 42], patch_size=[7, 7]),
        text_config=dict(TEXT, model_type="qwen2"),
        downsample_ratio=0.5,
    )
    torch.manual_seed(8)
    model = InternVLForConditionalGeneration(config).eval()
    processor = GotOcr2ImageProcessorPil(size={"height": 42, "width": 42}, crop_to_patches=True, min_patches=1,
                                         max_patches=4)
    return model, processor, _save(model, processor, folder, max_shard_size)


def qwen2_audio_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    config = Qwen2AudioConfig(
        audio_config=dict(d_model=48, encoder_layers=2, encoder_attention_heads=3, encoder_ffn_dim=96,
                          num_mel_bins=40, max_source_positions=300),
        text_config=dict(TEXT, model_type="qwen2"),
        audio_token_id=500,
    )
    torch.manual_seed(9)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    extractor = WhisperFeatureExtractor(feature_size=40, sampling_rate=8000, hop_length=80, chunk_length=6)
    return model, extractor, _save(model, extractor, folder, max_shard_size)
