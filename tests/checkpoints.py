"""Tiny full checkpoints (language model included) saved with `save_pretrained`, for parity tests.

Their sizes and processor settings differ from the built-ins on purpose, so the loader has to read
everything from the folder. `tiny_tokenizer` builds a word-level tokenizer offline (with `tokenizers`)
for the families' full processors, which need one to insert their placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from .tiny_parts import save_checkpoint as _save

TEXT = dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def as_resolved(processor, folder: Path):
    """The processor transformers itself resolves from the saved folder in this environment: where
    torchvision is installed, its torchvision backend, as on every GPU machine. References are computed
    with it, so the server is compared with what a user of that environment gets from transformers."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    auto = AutoFeatureExtractor if "FeatureExtractor" in type(processor).__name__ else AutoImageProcessor
    return auto.from_pretrained(folder)


def qwen25_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=3, hidden_size=48, intermediate_size=96, num_heads=3, out_hidden_size=96,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[2]),
    )
    torch.manual_seed(7)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    folder = _save(model, processor, folder, max_shard_size)
    return model, as_resolved(processor, folder), folder


def qwen2_vl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=96, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
    )
    torch.manual_seed(10)
    model = Qwen2VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 48)
    folder = _save(model, processor, folder, max_shard_size)
    return model, as_resolved(processor, folder), folder


def internvl_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    config = InternVLConfig(
        vision_config=dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=96,
                           image_size=[42, 42], patch_size=[7, 7]),
        text_config=dict(TEXT, model_type="qwen2"),
        downsample_ratio=0.5,
    )
    torch.manual_seed(8)
    model = InternVLForConditionalGeneration(config).eval()
    processor = GotOcr2ImageProcessorPil(size={"height": 42, "width": 42}, crop_to_patches=True, min_patches=1,
                                         max_patches=4)
    folder = _save(model, processor, folder, max_shard_size)
    return model, as_resolved(processor, folder), folder


def qwen2_audio_checkpoint(folder: Path, max_shard_size: str | None = None):
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, WhisperFeatureExtractor

    config = Qwen2AudioConfig(
        audio_config=dict(d_model=48, encoder_layers=2, encoder_attention_heads=3, encoder_ffn_dim=96,
                          num_mel_bins=40, max_source_positions=300),
        text_config=dict(TEXT, model_type="qwen2"),
        audio_token_id=500,
    )
    torch.manual_seed(9)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    extractor = WhisperFeatureExtractor(feature_size=40, sampling_rate=8000, hop_length=80, chunk_length=6)
    folder = _save(model, extractor, folder, max_shard_size)
    return model, as_resolved(extractor, folder), folder


def tiny_tokenizer(named: Mapping[str, str] | None = None, plain: Sequence[str] = ()):
    """A word-level tokenizer whose special tokens (`named`: attribute name -> token, as a family's
    processor looks them up, e.g. `context_image_token`; `plain`: unnamed ones) are single ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "describe", "this", "please", "."]
    specials = [*(named or {}).values(), *plain]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words + specials)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                   extra_special_tokens=dict(named) if named else list(plain))


QWEN_VL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}
QWEN_AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")


def qwen2_audio_full_processor(extractor):
    """Qwen2-Audio's full processor (feature extractor + tokenizer), as the prefill side loads it."""
    from transformers import Qwen2AudioProcessor

    return Qwen2AudioProcessor(extractor, tiny_tokenizer(plain=QWEN_AUDIO_TOKENS))


PREFILL_REFERENCE = Path(__file__).parent / "data" / "prefill_reference.json"
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def install_reference_processor(folder: Path, family: str) -> dict:
    """Replace the folder's processor configs with the ones the family's full processor saved in
    `tools/reference/reference_prefill_counts.py`; returns that family's recorded placeholder counts."""
    import json

    entry = json.loads(PREFILL_REFERENCE.read_text())[family]
    for name in PROCESSOR_FILES:
        (folder / name).unlink(missing_ok=True)
    for name, content in entry["files"].items():
        (folder / name).write_text(json.dumps(content))
    return entry
