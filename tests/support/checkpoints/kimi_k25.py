"""A tiny full Kimi K2.5 checkpoint (language model, processor and tokenizer included), saved with
`save_pretrained` as `transformers` writes it: the tower's attention as fused `wqkv` rows (rope-permuted),
so loading the folder exercises the key conversion `from_pretrained` applies. Its processors need torchvision.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import save_checkpoint as _save
from tests.support.tiny_parts import word_tokenizer

WORDS = ["describe", "please", "video", "seconds"]


KIMI_TOKENS = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}


KIMI_SPECIALS = ["<|media_pad|>", "<|kimi_k25_video_placeholder|>", "<|media_begin|>", "<|media_content|>",
                 "<|media_end|>", "<|media_start|>"]


def kimi_k25_checkpoint(folder: Path, max_shard_size: str | None = None):
    """Kimi K2.5: MoonViT-3D patches of 14 merged 2x2 (temporal pooling over 4-frame chunks), DeepSeek-V3 text."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25Processor
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    tokenizer = word_tokenizer(WORDS, KIMI_SPECIALS, KIMI_TOKENS)
    text = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96,
                moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1,
                q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                n_group=1, topk_group=1, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    vision = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=4,
                  num_hidden_layers=2, hidden_size=48, intermediate_size=96, merge_kernel_size=[2, 2])
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=48,
                            image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
                            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|media_start|>"),
                            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|media_end|>"))
    torch.manual_seed(41)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    # Up to 12 x 12 patches a side and 64 patches an image; 40 patches a video frame.
    image_processor = Kimi_K25ImageProcessor(size={"max_height": 12, "max_width": 12}, max_patches=64)
    video_processor = Kimi_K25VideoProcessor(size={"max_height": 12, "max_width": 12}, max_patches=40)
    processor = Kimi_K25Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  video_processor=video_processor)
    return model, _save(model, processor, folder, max_shard_size)
