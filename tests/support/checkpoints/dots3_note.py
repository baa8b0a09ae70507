"""A tiny full Dots3-Note checkpoint (language model, processor and tokenizer included), saved with
`save_pretrained` as a published model would be, with a character-level tokenizer (see `muse_spark`). Its
processors need torchvision."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import char_tokenizer

DOTS_TOKENS = ["<|imgpad|>", "<|img|>", "<|endofimg|>", "<|video_pad|>", "<|audio_comp_pad|>", "<|audio_comp_start|>",
               "<|audio_comp_end|>", "<|vision_start|>", "<|vision_end|>"]


MUSE_SAMPLING_RATE, DOTS_SAMPLING_RATE = 24000, 16000


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
