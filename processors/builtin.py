"""Built-in tiny models: real `transformers` encoder architectures from small configs and a fixed seed.

They need no download, and two processes (or two ranks) that build the same name hold bit-identical
weights, because the weights come from `torch.manual_seed(BUILTIN_SEED)` on the CPU.

- tiny-qwen2.5-vl: Qwen2.5-VL vision tower + merger (4 blocks, width 128, patch 14, merge 2);
  Qwen2-VL processor (PIL), 56x56 to 448x448 pixels per image or video frame.
- tiny-internvl: InternVL vision tower (2 layers, width 64, 56x56 tiles of 14x14 patches) + projector;
  GotOcr2 processor (PIL), 1 to 6 tiles plus a thumbnail.
- tiny-qwen2-audio: Qwen2-Audio tower (2 layers, width 64, 80 mel bins, 10 s window) + projector;
  Whisper features at 16 kHz.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import EncoderAdapter

BUILTIN_SEED = 1234


def _seeded(build: Callable[[], object]) -> object:
    """Build modules on the CPU from a fixed seed, without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILTIN_SEED)
        return build()


def tiny_qwen25_vl(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .qwen_vl import QwenVisionAdapter, VideoSettings

    config = Qwen2_5_VLVisionConfig(
        depth=4, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=128,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1, 3],
    )
    config._attn_implementation = "sdpa"
    tower = _seeded(lambda: Qwen2_5_VisionTransformerPretrainedModel._from_config(config).float())
    # Up to 448x448 pixels per image or frame: at most 256 rows each, which keeps CPU forwards short.
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    video = VideoSettings(min_pixels=56 * 56, max_pixels=448 * 448)
    return QwenVisionAdapter("tiny-qwen2.5-vl", tower, processor, device, dtype, video=video)


def tiny_internvl_config():
    from transformers import InternVLConfig

    return InternVLConfig(
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=[56, 56], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
        downsample_ratio=0.5,
    )


def tiny_internvl(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from .internvl import InternVLAdapter, build_internvl_encoder

    config = tiny_internvl_config()
    vision_tower, projector = _seeded(lambda: build_internvl_encoder(config))
    processor = GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=6,
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
    )
    return InternVLAdapter("tiny-internvl", vision_tower.float(), projector.float(), config, processor,
                           device, dtype)


def tiny_qwen2_audio_config():
    from transformers import Qwen2AudioConfig

    return Qwen2AudioConfig(
        audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                          num_mel_bins=80, max_source_positions=500),
        text_config=dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    )


def tiny_qwen2_audio(device: torch.device, dtype: torch.dtype) -> EncoderAdapter:
    from transformers import WhisperFeatureExtractor

    from .qwen_audio import QwenAudioAdapter, build_qwen2_audio_encoder

    config = tiny_qwen2_audio_config()
    audio_tower, projector = _seeded(lambda: build_qwen2_audio_encoder(config))
    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=10)
    return QwenAudioAdapter("tiny-qwen2-audio", audio_tower.float(), projector.float(), config, extractor,
                            device, dtype)


BUILTIN_MODELS: dict[str, Callable[[torch.device, torch.dtype], EncoderAdapter]] = {
    "tiny-qwen2.5-vl": tiny_qwen25_vl,
    "tiny-internvl": tiny_internvl,
    "tiny-qwen2-audio": tiny_qwen2_audio,
}
