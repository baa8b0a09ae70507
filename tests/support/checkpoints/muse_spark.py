"""A tiny full Muse Spark checkpoint (language model, processor and tokenizer included), saved with
`save_pretrained` as a published model would be. The tokenizer is character-level with the family's special
tokens matched whole, so text the processor inserts around placeholders (`Time: 1.0s` before each video
clip) survives a round trip. Its processors need torchvision."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import char_tokenizer

MUSE_TOKENS = ["<|patch|>", "<|image_start|>", "<|image_end|>", "<|video|>", "<|vid_frame_separator|>",
               "<|vid_start|>", "<|vid_end|>", "<|audio|>", "<|soft_audio_start|>", "<|soft_audio_end|>"]


MUSE_SAMPLING_RATE, DOTS_SAMPLING_RATE = 24000, 16000


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
