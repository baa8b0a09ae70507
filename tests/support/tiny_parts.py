"""Parts the tiny test checkpoints (`tests/support/checkpoints/`) are made of, each written once: seeded media
(`random_image`, `clip`/`video`, `waveform`, `wav_b64`), tokenizers built offline (word-level `word_tokenizer` and
`tiny_tokenizer`, character-level `char_tokenizer`), small language-model configs (`TEXT`, `small_text`), saving a
model with its processor, the processor `transformers` resolves from a folder (`as_resolved`), and the prefill
side's recorded processor files (`install_reference_processor`).

Importable without the project's test helpers (only numpy, PIL, tokenizers and transformers), like the checkpoint
modules that use it, so `tools/compat/sglang_compat.py` can build the same folders in the side venv.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from tests.support import paths


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """An RGB image of uniform random pixels from a fixed seed."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def word_tokenizer(words: Sequence[str], specials: Sequence[str], named: dict[str, str] | None = None):
    """A word-level fast tokenizer (`<pad>`, `<eos>`, `<bos>`, `<unk>`, then `specials`, then `words`) whose special
    tokens, the family's media tokens among them, are matched anywhere in the text and never split; `named` gives
    them the attribute names the family's processor looks them up by (e.g. `image_token`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: index for index, token in enumerate([*base, *specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([*base, *specials])
    kwargs = {"extra_special_tokens": named} if named else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", **kwargs)


def save_checkpoint(model, processor, folder: Path, max_shard_size: str | None = None) -> Path:
    """`save_pretrained` of the model (in shards of `max_shard_size` when given) and its processor into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    processor.save_pretrained(folder)
    return folder


TEXT = dict(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def as_resolved(processor, folder: Path):
    """The processor transformers itself resolves from the saved folder in this environment: where
    torchvision is installed, its torchvision backend, as on every GPU machine. References are computed
    with it, so the server is compared with what a user of that environment gets from transformers."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    auto = AutoFeatureExtractor if "FeatureExtractor" in type(processor).__name__ else AutoImageProcessor
    return auto.from_pretrained(folder)


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


PREFILL_REFERENCE = paths.DATA / "prefill_reference.json"


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


def clip(frames: int, width: int, height: int, seed: int) -> list[Image.Image]:
    return [random_image(width, height, seed * 100 + index) for index in range(frames)]


def video(width: int, height: int, frames: int, seed: int) -> list[Image.Image]:
    """`clip(frames, width, height, seed)`, in the order the Omni-family tests write it."""
    return clip(frames, width, height, seed)


def char_tokenizer(specials: list[str]):
    """A fast tokenizer with one token per printable ASCII character, and `specials` matched whole."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<eos>", "<bos>", "<unk>"]
    characters = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {token: index for index, token in enumerate(base + specials + characters)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(base + specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def waveform(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A mono float32 clip: a few tones and some noise (loud enough that every row is far from zero)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    tones = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, np.pi)) for f in rng.uniform(80, 3000, size=3))
    return (0.2 * tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def wav_b64(wave: np.ndarray, rate: int) -> str:
    """A clip as the base64 of a float32 WAV file (lossless, so the server decodes exactly `wave`)."""
    import base64
    import io

    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


TEXT_WORDS = ["hello", "image", "here", "is", "the", "original", "and", "are", "some", "crops", "to", "help", "you",
              "see", "better", "describe"]


def small_text(hidden: int = 64, **extra) -> dict:
    """A one-layer language model's config, small enough for CPU tests."""
    return dict(vocab_size=64, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, **extra)
