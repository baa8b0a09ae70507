"""Tiny full Kimi K2.5, GLM-5-Next and MiniMax-M3 VL checkpoints (language model, processor and tokenizer
included), saved with `save_pretrained` as `transformers` 5.23 writes them.

`save_pretrained` writes each model's published key layout (its conversion mapping reversed): Kimi K2.5's
attention as fused `wqkv` rows (rope-permuted), MiniMax-M3's tower under `vision_tower.vision_model.*`, so
loading these folders exercises the key conversions `from_pretrained` applies. The tokenizers are
word-level `tokenizers` models built offline, each family's media tokens registered as special tokens, so
the full `transformers` processors (torchvision-backed for these three) insert their real placeholders.

Importable without the project's test helpers (only numpy, PIL, tokenizers, torch and transformers), so
`tools/compat/sglang_compat.py` can build the same folders in the side venv.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from . import tiny_parts
from .tiny_parts import random_image
from .tiny_parts import save_checkpoint as _save

WORDS = ["describe", "please", "video", "seconds"]

KIMI_TOKENS = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}
KIMI_SPECIALS = ["<|media_pad|>", "<|kimi_k25_video_placeholder|>", "<|media_begin|>", "<|media_content|>",
                 "<|media_end|>", "<|media_start|>"]
GLM5_SPECIALS = ["<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                 "<|end_of_video|>"]
MINIMAX_SPECIALS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]

#: Per model type: the prompts a user turn holds for one image and one video (before the processor expands
#: them), the token whose count is an item's rows, and the token the prompt carries per video.
PROMPTS = {
    "kimi_k25": {"image": "describe <|media_start|>image<|media_content|><|media_pad|><|media_end|> please",
                 "video": "describe <|kimi_k25_video_placeholder|> please",
                 "image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>",
                 "video_row_token": "<|kimi_k25_video_placeholder|>"},
    "glm5_next": {"image": "describe <|begin_of_image|><|image|><|end_of_image|> please",
                  "video": "describe <|begin_of_video|><|video|><|end_of_video|> please",
                  "image_token": "<|image|>", "video_token": "<|video|>",
                  "video_row_token": "<|image|>"},  # GLM fills a video's frames with image tokens
    "minimax_m3_vl": {"image": "describe ]<]image[>[ please", "video": "describe ]<]video[>[ please",
                      "image_token": "]<]image[>[", "video_token": "]<]video[>[",
                      "video_row_token": "]<]video[>["},
}

#: (width, height) of the test images: upscaled, square, wide, tall, downscaled.
IMAGE_SIZES = [(20, 30), (56, 56), (150, 70), (45, 190), (333, 250)]
#: (frames, width, height) of the test clips: one frame, odd and even counts, resized up and down.
CLIP_SIZES = [(1, 56, 56), (3, 100, 60), (5, 50, 150), (8, 200, 140)]


def clip(frames: int, width: int, height: int, seed: int) -> list[Image.Image]:
    return [random_image(width, height, seed * 100 + index) for index in range(frames)]


def sample_images() -> list[Image.Image]:
    return [random_image(w, h, 70 + seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]


def sample_clips() -> list[list[Image.Image]]:
    return [clip(n, w, h, 80 + seed) for seed, (n, w, h) in enumerate(CLIP_SIZES)]


def word_tokenizer(specials: list[str], named: dict[str, str] | None = None):
    """A word-level fast tokenizer whose special tokens include the family's media tokens."""
    return tiny_parts.word_tokenizer(WORDS, specials, named)


def kimi_k25_checkpoint(folder: Path, max_shard_size: str | None = None):
    """Kimi K2.5: MoonViT-3D patches of 14 merged 2x2 (temporal pooling over 4-frame chunks), DeepSeek-V3 text."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration, Kimi_K25Processor
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    tokenizer = word_tokenizer(KIMI_SPECIALS, KIMI_TOKENS)
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


def glm5_next_checkpoint(folder: Path, max_shard_size: str | None = None):
    """GLM-5-Next: patches of 14 merged 2x2, images padded onto a canvas of 4 to 40 tokens."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextProcessor
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    tokenizer = word_tokenizer(GLM5_SPECIALS)
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


def minimax_m3_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    """MiniMax-M3 VL: a CLIP-like tower with 3-D rope on patches of 14, 2x2 groups merged by the projector;
    videos attend in segments of 2 temporal patches."""
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig, MiniMaxM3VLProcessor
    from transformers.models.minimax_m3_vl.image_processing_minimax_m3_vl import MiniMaxM3VLImageProcessor
    from transformers.models.minimax_m3_vl.video_processing_minimax_m3_vl import MiniMaxM3VLVideoProcessor

    tokenizer = word_tokenizer(MINIMAX_SPECIALS)
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


CHECKPOINTS = {"kimi_k25": kimi_k25_checkpoint, "glm5_next": glm5_next_checkpoint,
               "minimax_m3_vl": minimax_m3_vl_checkpoint}
