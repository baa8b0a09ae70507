"""Tiny full checkpoints whose prompts can be compared token for token, text included.

For the architectures SGLang's language side serves with this encoder: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL (+MoE), Qwen3.5 (+MoE) and Qwen2-Audio. Each folder holds the tiny model (language model
included, `save_pretrained`) and its full processor: image and video processors or feature
extractor, as the parity tests build them (`tests/support/checkpoints/`), and a
tokenizer built offline that differs from theirs in one way: it is byte-level with no merges, so any
text survives encoding and decoding exactly (Qwen3-VL's `<t seconds>` before each temporal patch of
a video, for one), and its special tokens are single ids. The config's special token ids are the
tokenizer's, since SGLang's language side reads them from the config.

Importable from the project's venv and from the side venv that `tools/compat/sglang_compat.sh` builds
(`tools/compat/sglang_compat.py` uses these folders); running the video processors needs torchvision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: Model type -> architecture name (what SGLang picks its language-side processor by).
ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
}


VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")


END = "<|endoftext|>"


@dataclass(frozen=True)
class Prompts:
    """A checkpoint's placeholders per modality: what a prompt holds for one item, and the token its rows fill."""

    placeholder: dict[str, str]  # modality -> one item's placeholder in a prompt
    token: dict[str, str]  # modality -> the placeholder token the item's rows fill

    def prompt(self, modality: str, count: int = 1) -> str:
        """A prompt with `count` items of the modality."""
        return "Describe " + " and ".join([self.placeholder[modality]] * count) + " please."


VISION_PROMPTS = Prompts(
    placeholder={"image": "<|vision_start|><|image_pad|><|vision_end|>",
                 "video": "<|vision_start|><|video_pad|><|vision_end|>"},
    token={"image": "<|image_pad|>", "video": "<|video_pad|>"})


AUDIO_PROMPTS = Prompts(placeholder={"audio": "<|audio_bos|><|AUDIO|><|audio_eos|>"}, token={"audio": "<|AUDIO|>"})


def prompts_for(model_type: str) -> Prompts:
    return AUDIO_PROMPTS if model_type == "qwen2_audio" else VISION_PROMPTS


def byte_level_tokenizer(specials: tuple[str, ...]):
    """Every byte one token (no merges), `specials` single ids after them; decodes back to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END, pad_token=END,
                                   additional_special_tokens=list(specials))


def _token_ids(config, tokenizer, names: dict[str, str]) -> None:
    for attribute, token in names.items():
        setattr(config, attribute, tokenizer.convert_tokens_to_ids(token))


def _vision_token_ids(config, tokenizer) -> None:
    _token_ids(config, tokenizer, {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                                   "vision_start_token_id": "<|vision_start|>",
                                   "vision_end_token_id": "<|vision_end|>"})


def _qwen2_video_processor(image_processor):
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = image_processor.size
    return Qwen2VLVideoProcessor(size={"shortest_edge": size.shortest_edge, "longest_edge": size.longest_edge})


def build(model_type: str, folder: Path) -> Path:
    """The tiny checkpoint of `model_type` with its full processor, saved in `folder`."""
    folder = Path(folder)
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

        from tests.support.checkpoints.qwen_vl import qwen2_vl_checkpoint, qwen25_vl_checkpoint

        make, processor_class = ((qwen2_vl_checkpoint, Qwen2VLProcessor) if model_type == "qwen2_vl"
                                 else (qwen25_vl_checkpoint, Qwen2_5_VLProcessor))
        model, image_processor, _ = make(folder)
        tokenizer = byte_level_tokenizer(VISION_TOKENS)
        processor = processor_class(image_processor=image_processor, tokenizer=tokenizer,
                                    video_processor=_qwen2_video_processor(image_processor))
        _vision_token_ids(model.config, tokenizer)
    elif model_type == "qwen2_audio":
        from transformers import Qwen2AudioProcessor

        from tests.support.checkpoints.qwen2_audio import qwen2_audio_checkpoint

        model, extractor, _ = qwen2_audio_checkpoint(folder)
        tokenizer = byte_level_tokenizer(AUDIO_TOKENS)
        processor = Qwen2AudioProcessor(extractor, tokenizer)
        _token_ids(model.config, tokenizer, {"audio_token_id": "<|AUDIO|>"})
    else:
        from transformers import AutoProcessor

        from tests.support.checkpoints.grid_vision import build_model, write_processor_files

        model = build_model(model_type, seed=40)
        model.save_pretrained(folder)
        write_processor_files(folder, model_type, "nested")
        tokenizer = byte_level_tokenizer(VISION_TOKENS)
        processor = AutoProcessor.from_pretrained(folder, tokenizer=tokenizer)
        _vision_token_ids(model.config, tokenizer)
    model.config.architectures = [ARCHITECTURES[model_type]]
    model.config.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


SECONDS = re.compile(r"<([^<>]*) seconds>")


def prompt_timestamps(text: str) -> list[str]:
    """The `<t seconds>` texts written into a decoded prompt, in order (`t` as written, e.g. "1.2")."""
    return SECONDS.findall(text)
