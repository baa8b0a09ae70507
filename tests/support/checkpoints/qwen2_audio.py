"""A tiny full Qwen2-Audio checkpoint (language model included), saved with `save_pretrained`, and the
full processor the prefill side loads."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import TEXT, as_resolved, tiny_tokenizer
from tests.support.tiny_parts import save_checkpoint as _save


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
    folder = _save(model, extractor, folder, max_shard_size)
    return model, as_resolved(extractor, folder), folder


QWEN_AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")


def qwen2_audio_full_processor(extractor):
    """Qwen2-Audio's full processor (feature extractor + tokenizer), as the prefill side loads it."""
    from transformers import Qwen2AudioProcessor

    return Qwen2AudioProcessor(extractor, tiny_tokenizer(plain=QWEN_AUDIO_TOKENS))
