"""Tiny full Qwen2.5-Omni and Qwen3-Omni checkpoints (thinker with its language model, processor, tokenizer),
saved with `save_pretrained`, and the media the Omni tests use.

Importable in the project's venv and in the side venv that runs SGLang (`tools/compat/sglang_compat.py`): it
needs only numpy, PIL, tokenizers, torch and transformers. The full processors need torchvision (their
video processor), which both venvs have.

Processor files come in two layouts: `nested` (`processor_config.json` holding every sub-processor,
what `save_pretrained` writes in transformers 5) and `flat` (one `preprocessor_config.json` holding the
image processor's and the feature extractor's settings together, as the published checkpoints ship
it; the video processor's settings then come from it too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from tests.support.tiny_parts import random_image

LAYOUTS = ("nested", "flat")


#: The tokens of each model's tokenizer, by the attribute names its processor reads.
TOKENS = {
    "qwen2_5_omni": {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                     "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                     "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
    "qwen3_omni_moe": {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
                       "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                       "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"},
}


WORDS = ["<unk>", "<pad>", "describe", "this", "and", "please", "."]


ROPE = {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}


TEXT = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, rope_parameters=ROPE)


#: Image sizes (width, height): upscaled, wide, tall, downscaled.
IMAGE_SIZES = [(30, 20), (150, 70), (45, 190), (333, 250)]


#: Clips (frames, width, height): even and odd frame counts, different sizes.
CLIP_SIZES = [(2, 64, 48), (3, 100, 60)]


#: Audio clip lengths in samples at 16 kHz (100 mel frames a second), per model: shorter than one audio chunk
#: (Qwen3-Omni: two of 30 frames and one of 50, lengths whose rows would change if padded), exactly one
#: chunk, several chunks with a partial last one; Qwen2.5-Omni up to its 4-second window here.
AUDIO_SAMPLES = {
    "qwen2_5_omni": [4800, 16000, 37_937, 63_990],
    "qwen3_omni_moe": [4800, 4815, 8000, 16000, 37_937, 54_400],
}


SAMPLING_RATE = 16000


def sample_images() -> list[Image.Image]:
    return [random_image(w, h, seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]


def sample_clips() -> list[list[Image.Image]]:
    return [[random_image(w, h, 100 * seed + frame) for frame in range(n)] for seed, (n, w, h) in enumerate(CLIP_SIZES)]


def audio_clip(samples: int, seed: int) -> np.ndarray:
    """A waveform with a tone and noise, loud enough that the log-mel features are not flat."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / SAMPLING_RATE
    return (0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) + 0.05 * rng.standard_normal(samples)).astype(np.float32)


def sample_audio(model_type: str) -> list[np.ndarray]:
    return [audio_clip(n, seed) for seed, n in enumerate(AUDIO_SAMPLES[model_type])]


def tokenizer(model_type: str):
    """A word-level tokenizer with the model's placeholder and boundary tokens as named special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named = TOKENS[model_type]
    vocab = {word: index for index, word in enumerate(WORDS + list(named.values()))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                   extra_special_tokens=dict(named))


def token_ids(model_type: str) -> dict[str, int]:
    return {name: WORDS.__len__() + index for index, name in enumerate(TOKENS[model_type])}


def model_config(model_type: str):
    import transformers

    ids = token_ids(model_type)
    if model_type == "qwen2_5_omni":
        thinker = dict(
            text_config=TEXT,
            vision_config=dict(depth=3, hidden_size=48, intermediate_size=90, num_heads=3, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[2]),
            audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                              d_model=32, max_source_positions=64, n_window=10, output_dim=64),
            audio_token_index=ids["audio_token"], image_token_index=ids["image_token"],
            video_token_index=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
            audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
            vision_end_token_id=ids["vision_eos_token"])
        return transformers.Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    if model_type == "qwen3_omni_moe":
        thinker = dict(
            text_config=dict(TEXT, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
            vision_config=dict(depth=3, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                               num_position_embeddings=64, deepstack_visual_indexes=[0, 2]),
            audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                              d_model=32, max_source_positions=64, n_window=50, n_window_infer=200,
                              output_dim=64, downsample_hidden_size=8),
            audio_token_id=ids["audio_token"], image_token_id=ids["image_token"], video_token_id=ids["video_token"],
            audio_start_token_id=ids["audio_bos_token"], vision_start_token_id=ids["vision_bos_token"],
            vision_end_token_id=ids["vision_eos_token"])
        return transformers.Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    raise ValueError(model_type)


def full_processor(model_type: str):
    """The model's full processor, with settings small enough for CPU tests (16 kHz Whisper, 16 mel bins)."""
    from transformers import Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    if model_type == "qwen2_5_omni":
        images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
        videos = Qwen2VLVideoProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 32)
        # A 4-second window: longer clips are cut by this processor (and refused by the server).
        extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=4)
        return Qwen2_5OmniProcessor(images, videos, extractor, tokenizer(model_type))
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 48,
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
    videos = Qwen2VLVideoProcessor(patch_size=16, merge_size=2, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 32,
                                   image_mean=[0.5] * 3, image_std=[0.5] * 3)
    extractor = WhisperFeatureExtractor(feature_size=16, sampling_rate=SAMPLING_RATE, chunk_length=4)
    return Qwen3OmniMoeProcessor(images, videos, extractor, tokenizer(model_type))


def build_model(model_type: str, seed: int):
    """The tiny full model from a fixed seed, in eval mode (float32). `transformers` initialises the audio
    convolutions' biases to zero; published checkpoints' are not, and they are what would make a short clip's
    rows depend on how far its chunk is padded (Qwen3-Omni), so they get values here."""
    import torch
    import transformers

    classes = {"qwen2_5_omni": transformers.Qwen2_5OmniForConditionalGeneration,
               "qwen3_omni_moe": transformers.Qwen3OmniMoeForConditionalGeneration}
    torch.manual_seed(seed)
    model = classes[model_type](model_config(model_type)).eval()
    with torch.no_grad():
        for module in model.thinker.model.audio_tower.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)) and module.bias is not None:
                module.bias.normal_(0, 1.0)
    return model


def flatten_processor_files(folder: Path) -> None:
    """Rewrite a `nested` folder as the published checkpoints lay it out: one `preprocessor_config.json` with
    the image processor's and the feature extractor's settings, and `processor_class`."""
    nested = json.loads((folder / "processor_config.json").read_text())
    flat = {**nested["feature_extractor"], **nested["image_processor"], "processor_class": nested["processor_class"]}
    (folder / "processor_config.json").unlink()
    (folder / "preprocessor_config.json").write_text(json.dumps(flat, indent=2))


def checkpoint(root: Path, model_type: str, seed: int, layouts=LAYOUTS):
    """The tiny model saved with its processor, one folder per layout: `(model, {layout: folder})`."""
    import shutil

    model = build_model(model_type, seed)
    first = root / f"{model_type}-{layouts[0]}"
    model.save_pretrained(first)
    full_processor(model_type).save_pretrained(first)
    folders = {layouts[0]: first}
    for layout in layouts[1:]:
        folders[layout] = root / f"{model_type}-{layout}"
        shutil.copytree(first, folders[layout])
    for layout, folder in folders.items():
        if layout == "flat":
            flatten_processor_files(folder)
    return model, folders
