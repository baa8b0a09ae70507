"""Parts every tiny test checkpoint is made of: seeded random images, a word-level tokenizer built offline, and
saving a model with its processor.

Importable without the project's test helpers (only numpy, PIL, tokenizers and transformers), like the checkpoint
modules that use it, so `tools/compat/sglang_compat.py` can build the same folders in the side venv.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image


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
