"""Tiny full checkpoints (language model, processor and tokenizer included) for Gemma 3, LLaVA-OneVision,
Mistral 3 and LLaVA (the generic path), and the prefill side's full processor for each.

The tokenizers are word-level `tokenizers` models built offline, with each family's image tokens as
special tokens. Two full processors cannot be built here the ordinary way, because `transformers`
5.23 ties them to torchvision (absent) for reasons that do not touch images:
`LlavaOnevisionProcessor` requires a video processor (torchvision-only), so it is built with its
image processor and tokenizer only; `processing_pixtral.py` imports torchvision at the top for its
torchvision image processor, so `PixtralProcessor` runs in a subprocess where that import is stubbed
(its PIL image processor and its prompt expansion are the real code).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .helpers import ROOT

TEXT_WORDS = ["hello", "image", "here", "is", "the", "original", "and", "are", "some", "crops", "to", "help", "you",
              "see", "better", "describe"]


def word_tokenizer(specials: list[str], named: dict[str, str] | None = None):
    """A word-level fast tokenizer whose special tokens include the family's image tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: index for index, token in enumerate(base + specials + TEXT_WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(base + specials)  # matched anywhere in the text, never split
    kwargs = {"extra_special_tokens": named} if named else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", **kwargs)


def random_image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max()
    assert scale > 0, "the reference rows are all zero: the test would prove nothing"
    return float(np.abs(a - b).max() / scale)


def spliced_rows(model, inputs: dict, image_token_id: int) -> torch.Tensor:
    """The rows the model's own forward puts at the image-token positions of `input_ids` (prompt 0)."""
    captured = {}

    def grab(module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"]

    decoders = [name for name, _ in model.named_modules()
                if name.rpartition(".")[2] in ("language_model", "text_model")]
    decoder = model.get_submodule(min(decoders, key=lambda name: name.count(".")))
    handle = decoder.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return captured["embeds"][0][inputs["input_ids"][0] == image_token_id]


def _text(hidden: int = 64, **extra) -> dict:
    return dict(vocab_size=64, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, **extra)


# --- Gemma 3 ---------------------------------------------------------------------------------------

GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def gemma3_checkpoint(folder: Path, image_seq_length: int = 16):
    """Gemma 3: 56x56 SigLIP input, 8x8 patches average-pooled to 4x4: 16 rows per image or crop."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = word_tokenizer(list(GEMMA3_TOKENS.values()), GEMMA3_TOKENS)
    config = Gemma3Config(
        text_config=_text(head_dim=32),
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


# --- LLaVA-OneVision -------------------------------------------------------------------------------

ONEVISION_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28], [84, 84]]


def llava_onevision_checkpoint(folder: Path, tower: str = "siglip_vision_model", strategy: str = "full"):
    """LLaVA-OneVision: 28x28 tiles of 4x4 patches, up to 3x3 tiles, anyres_max_2."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tokenizer = word_tokenizer(["<image>", "<video>"], {"image_token": "<image>", "video_token": "<video>"})
    config = LlavaOnevisionConfig(
        text_config=_text(model_type="qwen2"),
        vision_config=dict(model_type=tower, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, image_size=28, patch_size=7),
        image_token_id=tokenizer.image_token_id, video_token_id=tokenizer.video_token_id,
        image_grid_pinpoints=ONEVISION_PINPOINTS, vision_feature_select_strategy=strategy, vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_2",
    )
    torch.manual_seed(12)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                      image_grid_pinpoints=ONEVISION_PINPOINTS)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    # What LlavaOnevisionProcessor.save_pretrained writes (it cannot be built here: see the module docstring).
    num_image_tokens = 16 + (1 if tower == "clip_vision_model" else 0)  # CLIP's class token counts here
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": num_image_tokens,
        "vision_feature_select_strategy": strategy, "vision_aspect_ratio": "anyres_max_2"}))
    return model, folder


def llava_onevision_processor(folder: Path):
    """`LlavaOnevisionProcessor` from the folder, with its image processor and tokenizer (no video processor)."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyLlavaOnevisionProcessor.from_pretrained(folder)


# --- Mistral 3 -------------------------------------------------------------------------------------

MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def mistral3_checkpoint(folder: Path):
    """Mistral 3: Pixtral patches of 7 merged 2x2 (14-pixel rows), longest edge 84."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tokenizer = word_tokenizer(MISTRAL3_TOKENS)
    config = Mistral3Config(
        text_config=_text(model_type="mistral", head_dim=32),
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


# --- LLaVA (served by the generic path) -----------------------------------------------------------

def llava_checkpoint(folder: Path, num_additional_image_tokens: int = 1):
    """LLaVA: CLIP tower at 28x28 (4x4 patches + class token, "default" drops it): 16 rows per image."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer = word_tokenizer(["<image>"], {"image_token": "<image>"})
    config = LlavaConfig(
        text_config=_text(model_type="llama"),
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

    tokenizer = word_tokenizer(["<image>"], {"image_token": "<image>"})
    config = Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=7),
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            encoder_hidden_size=32, vocab_size=64),
        text_config=_text(model_type="opt", ffn_dim=96, word_embed_proj_dim=64), num_query_tokens=4,
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

    LlamaForCausalLM(LlamaConfig(**_text())).save_pretrained(folder)
    word_tokenizer([]).save_pretrained(folder)
    return folder
