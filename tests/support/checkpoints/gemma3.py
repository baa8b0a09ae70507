"""A tiny full Gemma 3 checkpoint (language model, processor and tokenizer included)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.tiny_parts import TEXT_WORDS, small_text, word_tokenizer

GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def gemma3_checkpoint(folder: Path, image_seq_length: int = 16):
    """Gemma 3: 56x56 SigLIP input, 8x8 patches average-pooled to 4x4: 16 rows per image or crop."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = word_tokenizer(TEXT_WORDS, list(GEMMA3_TOKENS.values()), GEMMA3_TOKENS)
    config = Gemma3Config(
        text_config=small_text(head_dim=32),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=7, vision_use_head=False),
        mm_tokens_per_image=16, boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    )
    torch.manual_seed(11)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # Gemma 3 initialises the projection to zeros; give it values the test can see
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    # Pan-and-scan enabled in the image processor's config: the full processor overrides it (see gemma3.py).
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=True,
                                              pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=3)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=image_seq_length)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, folder
