"""A tiny full MiniMax-M3 VL checkpoint (language model, processor and tokenizer included), saved with
`save_pretrained` in the published key layout (the tower under `vision_tower.vision_model.*`). Its processors
need torchvision."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import save_checkpoint as _save
from tests.support.tiny_parts import word_tokenizer

WORDS = ["describe", "please", "video", "seconds"]


MINIMAX_SPECIALS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]


def minimax_m3_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    """MiniMax-M3 VL: a CLIP-like tower with 3-D rope on patches of 14, 2x2 groups merged by the projector;
    videos attend in segments of 2 temporal patches."""
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig, MiniMaxM3VLProcessor
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

    tokenizer = word_tokenizer(WORDS, MINIMAX_SPECIALS)
    text = dict(vocab_size=64, hidden_size=64, intermediate_size=32, dense_intermediate_size=96,
                shared_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, rotary_dim=16, num_local_experts=2, num_experts_per_tok=1, index_n_heads=1,
                index_head_dim=16, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    vision = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2)
    config = MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=64,
                               image_token_index=tokenizer.convert_tokens_to_ids("]<]image[>["),
                               video_token_index=tokenizer.convert_tokens_to_ids("]<]video[>["))
    torch.manual_seed(43)
    model = MiniMaxM3SparseForConditionalGeneration(config).eval()
    image_processor = MiniMaxM3VLImageProcessor(size={"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 20})
    video_processor = MiniMaxM3VLVideoProcessor(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 12,
                                                vision_segment_max_frames=2)
    processor = MiniMaxM3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=video_processor)
    return model, _save(model, processor, folder, max_shard_size)
