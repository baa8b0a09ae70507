"""A tiny Voxtral checkpoint as a published folder holds one: `save_pretrained` weights (a 2-layer Whisper-style
audio encoder over 128 mel bins whose 4 adjacent positions the projector joins, a 1-layer Llama), the Whisper
feature extractor, and a `tekken.json` that `mistral_common` reads (byte-level vocabulary, the control tokens at
their published ids: `[AUDIO]` 24, `[BEGIN_AUDIO]` 25, `[TRANSCRIBE]` 34; audio at 16 kHz, 12.5 frames a
second, padded to 30-second chunks). Needs `mistral_common` (the test extra)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch

CONTROL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                  "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
                  *(f"<SPECIAL_{i}>" for i in range(20, 24)), "[AUDIO]", "[BEGIN_AUDIO]",
                  *(f"<SPECIAL_{i}>" for i in range(26, 34)), "[TRANSCRIBE]"]
SPECIAL_TOKENS = 100  # the rest are filler control tokens
AUDIO_TOKEN_ID = 24
#: Tekken's pre-tokenizer pattern, as published tokenizers hold it.
PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")


def tekken_json() -> dict:
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(),
              "token_str": chr(i) if 32 <= i < 127 else None} for i in range(256)]
    return {"config": {"pattern": PATTERN, "num_vocab_tokens": 256, "default_vocab_size": 256 + SPECIAL_TOKENS,
                       "default_num_special_tokens": SPECIAL_TOKENS, "version": "v7"},
            "vocab": vocab,
            "special_tokens": [{"rank": i, "token_str": text, "is_control": True}
                               for i, text in enumerate(CONTROL_TOKENS)],
            "audio": {"sampling_rate": 16000, "frame_rate": 12.5, "chunk_length_s": 30.0,
                      "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400}}}


def voxtral_checkpoint(folder: Path):
    """The model and the folder (weights, feature extractor, tekken.json)."""
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration, VoxtralProcessor, WhisperFeatureExtractor
    from transformers.tokenization_mistral_common import MistralCommonBackend

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tekken.json").write_text(json.dumps(tekken_json()))
    config = VoxtralConfig(
        audio_config={"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "num_mel_bins": 128, "max_source_positions": 1500},
        text_config={"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                     "vocab_size": 256 + SPECIAL_TOKENS},
        audio_token_id=AUDIO_TOKEN_ID)
    torch.manual_seed(34)
    model = VoxtralForConditionalGeneration(config).eval()
    processor = VoxtralProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128),
                                 tokenizer=MistralCommonBackend.from_pretrained(folder))
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, folder
