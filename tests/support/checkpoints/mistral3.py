"""A tiny full Mistral 3 checkpoint, and what the real `PixtralProcessor` gives for it: `processing_pixtral.py`
imports torchvision at the top for its torchvision image processor, so the processor runs in a subprocess
where that import is stubbed where torchvision is missing (its PIL image processor and prompt expansion are
the real code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image

from tests.support.paths import ROOT
from tests.support.tiny_parts import TEXT_WORDS, small_text, word_tokenizer

MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def mistral3_checkpoint(folder: Path):
    """Mistral 3: Pixtral patches of 7 merged 2x2 (14-pixel rows), longest edge 84."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = word_tokenizer(TEXT_WORDS, MISTRAL3_TOKENS)
    config = Mistral3Config(
        text_config=small_text(model_type="mistral", head_dim=32),
        vision_config=dict(model_type="pixtral", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, head_dim=12, image_size=112, patch_size=7),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
    )
    torch.manual_seed(13)
    model = Mistral3ForConditionalGeneration(config).eval()
    # The image processor's own patch_size (16) is overridden by the processor's 7 x 2 on every call.
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 84})
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 7, "spatial_merge_size": 2}))
    return model, folder


PIXTRAL_SUBPROCESS = r"""
import json, sys, types
from transformers.utils import is_torchvision_available
if not is_torchvision_available():  # cached before the stub: every image processor stays on PIL
    # PixtralProcessor's module imports torchvision names; stand-ins let it load on the PIL backend.
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoImageProcessor
from transformers.models.pixtral.processing_pixtral import PixtralProcessor
folder, out = sys.argv[1], sys.argv[2]
processor = PixtralProcessor.from_pretrained(folder)
# the image processor this environment resolves: torchvision's where it is installed, else PIL's
assert type(processor.image_processor) is type(AutoImageProcessor.from_pretrained(folder))
paths = json.loads(sys.argv[3])
for index, path in enumerate(paths):
    inputs = processor(text=["describe [IMG] image"], images=[Image.open(path).convert("RGB")], return_tensors="pt")
    save_file({key: value.contiguous() for key, value in inputs.items()}, f"{out}/{index}.safetensors")
"""


def pixtral_processor_outputs(folder: Path, images: list[Image.Image], work: Path) -> list[dict]:
    """What the real `PixtralProcessor` from the folder gives for a prompt with each image (run in a subprocess)."""
    from safetensors.torch import load_file

    work.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, image in enumerate(images):
        path = work / f"image{index}.png"
        image.save(path)
        paths.append(str(path))
    result = subprocess.run([sys.executable, "-c", PIXTRAL_SUBPROCESS, str(folder), str(work), json.dumps(paths)],
                            cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return [load_file(str(work / f"{index}.safetensors")) for index in range(len(images))]
