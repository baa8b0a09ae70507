"""A tiny full GLM-5-Next checkpoint (language model, processor and tokenizer included), saved with
`save_pretrained`. Its processors need torchvision."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import save_checkpoint as _save
from tests.support.tiny_parts import word_tokenizer

WORDS = ["describe", "please", "video", "seconds"]


GLM5_SPECIALS = ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                 "<|end_of_video|>"]


def glm5_next_checkpoint(folder: Path, max_shard_size: str | None = None):
    """GLM-5-Next: patches of 14 merged 2x2, images padded onto a canvas of 4 to 40 tokens."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextProcessor
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    tokenizer = word_tokenizer(WORDS, GLM5_SPECIALS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in GLM5_SPECIALS}
    text = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, n_routed_experts=2,
                num_experts_per_tok=1, kv_lora_rank=16, q_lora_rank=16, v_head_dim=16, qk_nope_head_dim=16,
                index_topk=16, index_head_dim=16, index_n_heads=1, linear_head_dim=16, linear_num_heads=2, hc_mult=2)
    vision = dict(depth=2, hidden_size=48, intermediate_size=96, num_heads=4, out_hidden_size=64,
                  projection_intermediate_size=96, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = Glm5NextConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                            video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                            image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                            video_end_token_id=ids["<|end_of_video|>"])
    torch.manual_seed(42)
    model = Glm5NextForConditionalGeneration(config).eval()
    image_processor = Glm5NextImageProcessor(min_image_tokens=4, max_image_tokens=40)
    video_processor = Glm5NextVideoProcessor(min_image_tokens=4, max_image_tokens=60)
    processor = Glm5NextProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                  video_processor=video_processor)
    return model, _save(model, processor, folder, max_shard_size)
