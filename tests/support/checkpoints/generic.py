"""Tiny checkpoints for the generic path: LLaVA (served exactly), BLIP-2 (its rows cannot be counted) and a
text-only Llama (nothing to encode)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import TEXT_WORDS, small_text, word_tokenizer


def llava_checkpoint(folder: Path, num_additional_image_tokens: int = 1):
    """LLaVA: CLIP tower at 28x28 (4x4 patches + class token, "default" drops it): 16 rows per image."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = word_tokenizer(TEXT_WORDS, ["<image>"], {"image_token": "<image>"})
    config = LlavaConfig(
        text_config=small_text(model_type="llama"),
        vision_config=dict(model_type="clip_vision_model", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, image_size=28, patch_size=7, projection_dim=32),
        image_token_id=tokenizer.image_token_id, vision_feature_select_strategy="default", vision_feature_layer=-2,
    )
    torch.manual_seed(14)
    model = LlavaForConditionalGeneration(config).eval()
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=7,
                               vision_feature_select_strategy="default",
                               num_additional_image_tokens=num_additional_image_tokens)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, folder


def blip2_checkpoint(folder: Path):
    """BLIP-2: a model with get_image_features whose processor cannot count an image's tokens from its size."""
    from transformers import Blip2Config, Blip2ForConditionalGeneration, Blip2Processor
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tokenizer = word_tokenizer(TEXT_WORDS, ["<image>"], {"image_token": "<image>"})
    config = Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=7),
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            encoder_hidden_size=32, vocab_size=64),
        text_config=small_text(model_type="opt", ffn_dim=96, word_embed_proj_dim=64), num_query_tokens=4,
        image_token_index=tokenizer.image_token_id,
    )
    model = Blip2ForConditionalGeneration(config).eval()
    processor = Blip2Processor(image_processor=BlipImageProcessorPil(size={"height": 28, "width": 28}),
                               tokenizer=tokenizer, num_query_tokens=4)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, folder


def llama_checkpoint(folder: Path):
    """A text-only model: nothing to encode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**small_text())).save_pretrained(folder)
    word_tokenizer(TEXT_WORDS, []).save_pretrained(folder)
    return folder
