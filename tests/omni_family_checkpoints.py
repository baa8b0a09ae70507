"""Tiny full checkpoints (language model, processor and tokenizer included) of the image + video + audio families
Muse Spark and Dots3-Note, saved with `save_pretrained` as a published model would be, and media to feed them.

The tokenizer is character-level (every printable ASCII character is a token) with the family's special tokens
matched whole, so text the processors insert around placeholders (Muse's `Time: 1.0s` before each video clip)
survives a round trip and can be compared. Both processors need torchvision (transformers 5.23 has no PIL backend
for them).
"""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .tiny_parts import random_image

MUSE_TOKENS = ["<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>", "<|vid_frame_separator|>",
               "<|vid_start|>", "<|vid_end|>", "<|audio|>", "<|soft_audio_start|>", "<|soft_audio_end|>"]
DOTS_TOKENS = ["<|imgpad|>", "<|img|>", "<|endofimg|>", "<|video_pad|>", "<|audio_comp_pad|>", "<|audio_comp_start|>",
               "<|audio_comp_end|>", "<|vision_start|>", "<|vision_end|>"]
MUSE_SAMPLING_RATE, DOTS_SAMPLING_RATE = 24000, 16000


def char_tokenizer(specials: list[str]):
    """A fast tokenizer with one token per printable ASCII character, and `specials` matched whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<eos>", "<bos>", "<unk>"]
    characters = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {token: index for index, token in enumerate(base + specials + characters)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(base + specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def waveform(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A mono float32 clip: a few tones and some noise (loud enough that every row is far from zero)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    tones = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, np.pi)) for f in rng.uniform(80, 3000, size=3))
    return (0.2 * tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def video(width: int, height: int, frames: int, seed: int) -> list[Image.Image]:
    return [random_image(width, height, seed * 100 + index) for index in range(frames)]


# --- Muse Spark ------------------------------------------------------------------------------------

def muse_spark_config(tokenizer, text_hidden: int = 64):
    from transformers import MuseSparkConfig

    ids = {name: tokenizer.convert_tokens_to_ids(token)
           for name, token in (("image", "<|patch|>"), ("video", "<|video|>"), ("audio", "<|audio|>"))}
    return MuseSparkConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         mlp_layer_types=["dense"], pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        # 4 heads so that two tensor-parallel ranks get two each; 8x8 positions interpolated to any grid.
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
                           pos_emb_height=8, pos_emb_width=8, patch_size=14, merge_size=2, patch_temporal=2),
        audio_config=dict(hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1], out_hidden_size=text_hidden),
        out_hidden_size=32 * 4, projector_hidden_size=48,
        image_token_id=ids["image"], video_token_id=ids["video"], audio_token_id=ids["audio"],
    )


def muse_spark_checkpoint(folder: Path, max_image_tokens: int = 16, max_video_frame_tokens: int = 6):
    """Muse Spark: 2 vision blocks (width 32, patch 14, merge 2), a 4-stage audio pyramid of 1920 samples per row."""
    from transformers import MuseSparkFeatureExtractor, MuseSparkForConditionalGeneration, MuseSparkProcessor
    from transformers.models.muse_glimmer.image_processing_muse_glimmer import MuseGlimmerImageProcessor
    from transformers.models.muse_glimmer.video_processing_muse_glimmer import MuseGlimmerVideoProcessor

    tokenizer = char_tokenizer(MUSE_TOKENS)
    config = muse_spark_config(tokenizer)
    torch.manual_seed(31)
    model = MuseSparkForConditionalGeneration(config).eval()
    processor = MuseSparkProcessor(
        image_processor=MuseGlimmerImageProcessor(max_image_tokens=max_image_tokens),
        video_processor=MuseGlimmerVideoProcessor(max_video_frame_tokens=max_video_frame_tokens),
        tokenizer=tokenizer, feature_extractor=MuseSparkFeatureExtractor(sampling_rate=MUSE_SAMPLING_RATE))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, folder


# --- Dots3-Note ------------------------------------------------------------------------------------

def dots3_note_config(tokenizer, text_hidden: int = 64):
    from transformers import Dots3NoteConfig

    ids = {name: tokenizer.convert_tokens_to_ids(token)
           for name, token in (("image", "<|imgpad|>"), ("video", "<|video_pad|>"), ("audio", "<|audio_comp_pad|>"))}
    return Dots3NoteConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=96,
                         moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         head_dim=24, n_routed_experts=4, num_experts_per_tok=2, shared_experts_intermediate_size=32,
                         index_head_dim=16, index_n_heads=2, index_topk=8, use_sliding_window=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        # A dense block then a block of 4 routed experts (2 per token), as the published pyramid has.
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           moe_intermediate_size=32, pyramid_num_routed=[-1, 4], num_experts_per_tok=2,
                           adapter_in_dim=32, adapter_out_dim=text_hidden),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          downsample_hidden_size=8, adapter_input_size=32, adapter_out_dim=text_hidden),
        image_token_id=ids["image"], video_token_id=ids["video"], audio_token_id=ids["audio"],
    )


def dots3_note_checkpoint(folder: Path, chunk_seconds: int = 3):
    """Dots3-Note: a MoE vision tower (patch 14, merge 2, one frame per temporal patch) and a 2-layer audio
    encoder over 128 mel bins (8 frames of 10 ms per row), audio cut into `chunk_seconds` chunks."""
    from transformers import Dots3NoteFeatureExtractor, Dots3NoteForConditionalGeneration, Dots3NoteProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = char_tokenizer(DOTS_TOKENS)
    config = dots3_note_config(tokenizer)
    torch.manual_seed(32)
    model = Dots3NoteForConditionalGeneration(config).eval()
    pixels = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 12}
    processor = Dots3NoteProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixels, temporal_patch_size=1, merge_size=2, patch_size=14),
        video_processor=Qwen3VLVideoProcessor(size=pixels, temporal_patch_size=1, merge_size=2, patch_size=14),
        tokenizer=tokenizer, feature_extractor=Dots3NoteFeatureExtractor(chunk_length=chunk_seconds))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, folder


def wav_b64(wave: np.ndarray, rate: int) -> str:
    """A clip as the base64 of a float32 WAV file (lossless, so the server decodes exactly `wave`)."""
    import base64
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()
