"""Build one tiny checkpoint folder for a `model_type`, the way a Hub folder holds one: the model class from
transformers' auto mapping with a shrunk config (`shrink.py`) and a fixed seed, saved with `save_pretrained`;
its processor class with the default sub-processors of its type and an offline word-level tokenizer holding
the processor's special tokens; the config's placeholder token ids made equal to the tokenizer's ids.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from tests.support.zoo import shrink
from tests.support.zoo.catalog import (
    CHAT_TEMPLATES,
    FILLED_TOKENS,
    HAND_BUILT,
    IMAGE_PROCESSOR_SETTINGS,
    MODEL_CLASS_OVERRIDES,
    PROCESSOR_SETTINGS,
    config_extra,
    model_class_name,
    processor_class_name,
)

WORDS = ["describe", "this", "please", "what", "is", "in", "the", "image", "audio", "video", "user", "assistant",
         "system", "hello", "and", "a", "of", "transcribe", "text"]
BASE_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
#: A token-looking literal in a processor's source: <...>, <|...|>, [UPPER_CASE], ▁-free and short.
TOKEN_LITERAL = re.compile(r"""["'](<\|?[A-Za-z0-9_:/.\-| ]{1,40}\|?>|\[[A-Z][A-Z_]{1,30}\]|\|[A-Z_]{2,30}\|)["']""")
NAMED_ACCESS = re.compile(r"tokenizer\.(\w+_token)\b|getattr\(tokenizer, [\"'](\w+_token)[\"']")
#: Processor attribute names for each modality's placeholder token, in order of preference.
MODALITY_TOKEN_NAMES = {"image": ("image_token", "image_pad_token", "img_token"),
                        "audio": ("audio_token", "audio_pad_token"),
                        "video": ("video_token", "video_pad_token")}
#: Synonyms between config id names and token names (config prefix -> token attribute prefixes).
SYNONYMS = {"boi": ("boi", "image_start", "start_of_image", "image_bos"), "eoi": ("eoi", "image_end", "end_of_image",
            "image_eos"), "boa": ("boa", "audio_start", "audio_bos"), "eoa": ("eoa", "audio_end", "audio_eos"),
            "vision_start": ("vision_start", "vision_bos"), "vision_end": ("vision_end", "vision_eos"),
            "audio_start": ("audio_start", "audio_bos"), "audio_end": ("audio_end", "audio_eos"),
            "image": ("image", "image_pad", "img"), "audio": ("audio", "audio_pad"), "video": ("video", "video_pad")}


class Unbuildable(Exception):
    """This type's tiny checkpoint cannot be built here; the message says why."""


def processor_sources(processor_class: type) -> str:
    """The source of the processor's module and of its base classes' modules (not ProcessorMixin's)."""
    texts = []
    for klass in processor_class.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or not klass.__module__.startswith("transformers.models."):
            continue
        try:
            texts.append(inspect.getsource(module))
        except (OSError, TypeError):
            pass
    return "\n".join(texts)


def named_accesses(line: str) -> list[str]:
    """The token names a source line reads from its tokenizer (`tokenizer.boa_token`, `getattr(tokenizer, "...")`)."""
    return [a or b for a, b in NAMED_ACCESS.findall(line)]


def special_tokens(processor_class: type) -> tuple[list[str], dict[str, str]]:
    """The token literals a processor's source uses, and the named ones it reads from its tokenizer."""
    source = processor_sources(processor_class)
    literals = list(dict.fromkeys(TOKEN_LITERAL.findall(source)))
    named: dict[str, str] = {}
    for line in source.splitlines():
        names = named_accesses(line)
        found = TOKEN_LITERAL.findall(line)
        for name in names:
            if len(found) == 1 and name not in named:
                named[name] = found[0]
    for klass in processor_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, parameter in inspect.signature(init).parameters.items():
            if name.endswith("_token") and isinstance(parameter.default, str) and name not in named:
                named[name] = parameter.default
                literals.append(parameter.default)
    for klass in processor_class.__mro__:  # class constants (MiniMax M3's IMAGE_TOKEN = "]<]image[>[")
        for name, value in vars(klass).items():
            if name.isupper() and name.endswith("_TOKEN") and isinstance(value, str) and value:
                literals.append(value)
    standard = {"pad_token", "bos_token", "eos_token", "unk_token", "sep_token", "cls_token", "mask_token"}
    invent = "AddedToken(" not in source  # a processor that adds its own token when the tokenizer lacks it
    for line in source.splitlines() if invent else ():  # read from the tokenizer, no literal: a token of our own
        for name in named_accesses(line):
            if name not in named and name not in standard:
                named[name] = f"<|{name.removesuffix('_token')}|>"
                literals.append(named[name])
    literals = [t for t in dict.fromkeys(literals) if t not in BASE_TOKENS]
    return literals, named


def word_tokenizer(specials: list[str], named: dict[str, str]):
    """A word-level fast tokenizer: the base tokens, the processor's special tokens, a few words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(BASE_TOKENS + specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(BASE_TOKENS + specials)
    standard = {"pad_token", "bos_token", "eos_token", "unk_token", "sep_token", "cls_token", "mask_token"}
    extra = {name: token for name, token in named.items() if name not in standard}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>", extra_special_tokens=extra)
    if len(vocab) >= shrink.VOCAB:
        raise Unbuildable(f"{len(vocab)} tokens do not fit the tiny vocabulary of {shrink.VOCAB}")
    return tokenizer


def mapping_class(kind: str, keys: list[str]) -> type | None:
    """The default sub-processor class of one of `keys` (model types) for an attribute kind."""
    from transformers.utils import is_torchvision_available

    if kind == "image_processor":
        from transformers.models.auto.image_processing_auto import (
            IMAGE_PROCESSOR_MAPPING_NAMES as names,
        )
        from transformers.models.auto.image_processing_auto import (
            get_image_processor_class_from_name as load,
        )
    elif kind == "video_processor":
        from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES as names
        from transformers.models.auto.video_processing_auto import video_processor_class_from_name as load
    else:
        from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES as names
        from transformers.models.auto.feature_extraction_auto import feature_extractor_class_from_name as load
    for key in keys:
        value = names.get(key)
        if value is None:
            continue
        if isinstance(value, dict):
            backend = "torchvision" if is_torchvision_available() else "pil"
            value = value.get(backend) or value.get("pil") or value.get("torchvision")
        elif isinstance(value, (tuple, list)):
            value = next((v for v in value if v), None)
        if value:
            klass = load(value)
            if klass is not None:
                return klass
    return None


def lookup_keys(model_type: str, processor_class: type, config: Any) -> list[str]:
    keys = [model_type]
    module = processor_class.__module__.split(".")
    if len(module) > 2:
        keys.append(module[2])
    for name in shrink.sub_config_names(config):
        keys.append(getattr(config, name).model_type)
    return list(dict.fromkeys(keys))


#: Processor settings a Hub folder holds that the config knows under another name.
SETTING_SYNONYMS = {"image_seq_length": ("mm_tokens_per_image", "num_image_tokens", "image_seq_length"),
                    "num_image_tokens": ("num_image_tokens", "image_seq_length", "mm_tokens_per_image"),
                    "merge_size": ("spatial_merge_size", "merge_size")}


def config_values(config: Any) -> dict[str, Any]:
    """Every attribute of the config tree, the top level winning over sub-configs."""
    values: dict[str, Any] = {}
    queue = [config]
    while queue:
        current = queue.pop(0)
        for key, value in vars(current).items():
            if shrink.is_config(value):
                queue.append(value)
            elif key not in values:
                values[key] = value
    return values


def settings_from_config(processor_class: type, config: Any, given: dict[str, Any]) -> dict[str, Any]:
    """Processor `__init__` arguments left at None that the config determines (patch size, feature strategy,
    query tokens...): what a Hub folder's processor_config.json holds."""
    values = config_values(config)
    out = {}
    for klass in processor_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, parameter in inspect.signature(init).parameters.items():
            if name == "num_additional_image_tokens" and name not in given:  # the tower's class token
                vision = getattr(config, "vision_config", None)
                out[name] = 1 if getattr(vision, "model_type", "") == "clip_vision_model" else 0
                continue
            if name in given or name in out or parameter.default is not None and name not in SETTING_SYNONYMS:
                continue
            for source in SETTING_SYNONYMS.get(name, (name,)):
                if values.get(source) is not None:
                    out[name] = values[source]
                    break
            else:
                if name in ("image_seq_length", "num_image_tokens"):  # one row per patch of the tower's image
                    vision = getattr(config, "vision_config", None)
                    size, patch = (square(getattr(vision, "image_size", None)),
                                   square(getattr(vision, "patch_size", None)))
                    if size and patch:
                        out[name] = (size // patch) ** 2
    return out


def audio_geometry(extractor_class: type, config: Any) -> dict[str, Any]:
    """The feature extractor's mel bins set to the audio tower's `num_mel_bins`, as a Hub folder pairs them."""
    values = config_values(config)
    bins = values.get("num_mel_bins") or values.get("n_mels") or values.get("feature_size")
    if not isinstance(bins, int):
        return {}
    parameters = inspect.signature(extractor_class.__init__).parameters
    for name in ("feature_size", "num_mel_bins", "n_mels"):
        if name in parameters:
            return {name: bins}
    return {}


def square(value: Any) -> int | None:
    """A size given as an int or as a square [h, w] pair (InternVL's [448, 448]), else None."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def match_image_size(image_processor: Any, config: Any) -> None:
    """A fixed-size image processor resized to the vision tower's `image_size`, and its patch, merge and temporal
    patch sizes set to the tower's, as a Hub folder pairs them (some types' defaults disagree)."""
    vision = getattr(config, "vision_config", None) or getattr(getattr(config, "thinker_config", None),
                                                               "vision_config", None)
    for attribute, sources in (("patch_size", ("patch_size",)), ("merge_size", ("spatial_merge_size", "merge_size")),
                               ("temporal_patch_size", ("temporal_patch_size",))):
        current = getattr(image_processor, attribute, None)
        wanted = next((square(getattr(vision, s, None)) for s in sources if square(getattr(vision, s, None))), None)
        if isinstance(current, int) and wanted is not None and current != wanted:
            setattr(image_processor, attribute, wanted)
    size = square(getattr(vision, "image_size", None))
    if size is None:
        return
    for attribute in ("size", "crop_size"):
        current = getattr(image_processor, attribute, None)
        if current is None:
            continue
        current = dict(current)
        keys = set(k for k, v in current.items() if v is not None)
        if keys == {"height", "width"}:
            setattr(image_processor, attribute, {"height": size, "width": size})
        elif keys == {"shortest_edge"}:
            setattr(image_processor, attribute, {"shortest_edge": size})


def build_processor(model_type: str, config: Any):
    import transformers

    name = processor_class_name(model_type)
    if name is None:
        raise Unbuildable("transformers maps no processor class to this model_type")
    try:
        processor_class = getattr(transformers, name)
    except Exception as exc:  # noqa: BLE001
        raise Unbuildable(f"{name} does not import: {str(exc).strip().splitlines()[0]}") from None
    specials, named = special_tokens(processor_class)
    tokenizer = word_tokenizer(specials, named)
    kwargs: dict[str, Any] = {}
    for attribute in processor_class.get_attributes():
        if "tokenizer" in attribute:
            kwargs[attribute] = tokenizer
            continue
        klass = mapping_class(attribute, lookup_keys(model_type, processor_class, config))
        if klass is None:
            raise Unbuildable(f"no default {attribute} class for {model_type}")
        kwargs[attribute] = klass(**audio_geometry(klass, config)) if attribute in ("feature_extractor",
                                                                                 "audio_processor") else klass()
        if attribute in ("image_processor", "video_processor"):
            match_image_size(kwargs[attribute], config)
        if attribute == "image_processor":
            for key, value in IMAGE_PROCESSOR_SETTINGS.get(model_type, {}).items():
                setattr(kwargs[attribute], key, value)
    kwargs.update(settings_from_config(processor_class, config, kwargs))
    kwargs.update(PROCESSOR_SETTINGS.get(model_type, {}))
    try:
        processor = processor_class(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise Unbuildable(f"{name}(...) fails: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") \
            from None
    if model_type in CHAT_TEMPLATES:
        processor.chat_template = CHAT_TEMPLATES[model_type].replace("{BOI}", str(getattr(processor, "boi_token", "")))
    return processor, tokenizer


def token_number(processor: Any, tokenizer: Any, prefix: str) -> int | None:
    """The id the processor itself gives this token (`image_token_id`: for Gemma 3 the filled soft token, while
    its `image_token` is the begin-of-image token a prompt holds), else the id of its string."""
    for candidate in SYNONYMS.get(prefix, (prefix,)):
        for holder in (tokenizer, processor):  # the tokenizer's named token first: Gemma 3's processor says boi
            value = getattr(holder, f"{candidate}_token_id", None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    text = token_string(processor, tokenizer, prefix)
    return tokenizer.get_vocab().get(text) if text is not None else None


def token_string(processor: Any, tokenizer: Any, prefix: str) -> str | None:
    for candidate in SYNONYMS.get(prefix, (prefix,)):
        for holder in (processor, tokenizer):
            value = getattr(holder, f"{candidate}_token", None)
            value = getattr(value, "content", value)  # an AddedToken
            if isinstance(value, str) and value:
                return value
    return None


def align_token_ids(config: Any, processor: Any, tokenizer: Any) -> dict[str, int]:
    """Set every placeholder/boundary token id of the config to the tokenizer's id for that token; ids the
    tokenizer has no token for and that fall outside the tiny vocabulary get spare ids. Returns what was set."""
    vocab = tokenizer.get_vocab()
    for modality in MODALITY_TOKEN_NAMES:  # placeholder ids a config leaves unset (None)
        number = token_number(processor, tokenizer, modality)
        for holder in (config, getattr(config, "thinker_config", None)):
            for key in (f"{modality}_token_id", f"{modality}_token_index"):
                if holder is not None and key in vars(holder) and getattr(holder, key) is None and number is not None:
                    setattr(holder, key, number)
    spare = iter(range(shrink.VOCAB - 1, len(vocab), -1))
    assigned: dict[str, int] = {}
    for path, value in shrink.token_id_attributes(config).items():
        key = path.rsplit(".", 1)[-1]
        prefix = re.sub(r"(_token_id|_token_index|_token_ids|_index|_id)$", "", key)
        number = token_number(processor, tokenizer, prefix)
        new: Any = value
        if number is not None:
            new = number if not isinstance(value, list) else [number]
        elif isinstance(value, list):
            new = [v if v < shrink.VOCAB else next(spare) for v in value]
        elif value >= shrink.VOCAB or value < 0 and key.endswith(("token_id", "token_index")) and False:
            new = next(spare)
        elif any(word in prefix for word in ("image", "video", "audio", "vision", "boi", "eoi")):
            new = next(spare)  # a media id the tokenizer has no token for: keep it from colliding with ours
        if new != value:
            shrink.set_path(config, path, new)
            assigned[path] = new
    return assigned


def modality_token_ids(config: Any, processor: Any, tokenizer: Any) -> dict[str, tuple[str, int]]:
    """For each modality the processor serves: its placeholder token string and id."""
    out = {}
    vocab = tokenizer.get_vocab()
    for modality, names in MODALITY_TOKEN_NAMES.items():
        has = {"image": "image_processor", "audio": ("feature_extractor", "audio_processor"),
               "video": "video_processor"}[modality]
        if not any(getattr(processor, attr, None) is not None for attr in ((has,) if isinstance(has, str) else has)):
            continue
        for name in names:
            text = getattr(processor, name, None) or getattr(tokenizer, name, None)
            text = getattr(text, "content", text)  # an AddedToken
            if isinstance(text, str) and text in vocab:
                number = token_number(processor, tokenizer, modality)
                out[modality] = (text, number if isinstance(number, int) else vocab[text])
                break
    return out


def set_vocabulary_map(config: Any, tokenizer: Any) -> None:
    """Models that quantise an image into codes of their own vocabulary (Chameleon, Emu3) read a `vocabulary_map`
    (token name -> id) a Hub config holds: here <image>, and one named token per code of the tiny VQ codebook on
    ids the tokenizer leaves free."""
    if "vocabulary_map" not in vars(config):
        return
    vocab = tokenizer.get_vocab()
    codes = getattr(config.vq_config, "num_embeddings", None) or config.vq_config.codebook_size
    first = shrink.VOCAB - codes - 8
    if first <= len(vocab):
        raise Unbuildable(f"a codebook of {codes} codes does not fit the tiny vocabulary")
    letters = "ABCDEFGHIJ"
    if config.model_type == "chameleon":  # IMGIMG + the code's digits as letters + Z
        names = ["IMGIMG" + "".join(letters[int(d)] for d in str(i)) + "Z" for i in range(codes)]
    else:  # Emu3: <|visual token000042|>, and its end-of-line token
        names = [f"<|visual token{i:06d}|>" for i in range(codes)]
    mapping = {name: first + i for i, name in enumerate(names)}
    mapping["<image>"] = vocab["<image>"] if "<image>" in vocab else tokenizer.convert_tokens_to_ids(
        getattr(tokenizer, "image_token", "<image>"))
    if config.model_type != "chameleon":
        mapping["<|extra_200|>"] = vocab.get("<|extra_200|>", first + codes)
    config.vocabulary_map = mapping
    config.image_token_id = mapping["<image>"]


def set_dtype(config: Any, dtype: torch.dtype) -> None:
    """The dtype of the config and every sub-config (Llama 4's defaults leave its towers in bfloat16)."""
    config.dtype = dtype
    for name in shrink.sub_config_names(config):
        set_dtype(getattr(config, name), dtype)


def randomize_zero_weights(model: torch.nn.Module) -> None:
    """Give zero-initialised matrices (some projections start at zero) values a comparison can see."""
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim >= 2 and parameter.is_floating_point() and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def hand_built(model_type: str, folder: Path) -> dict[str, Any]:
    """The test suite's builder for this type; the placeholder ids are the saved config's own."""
    import importlib

    from transformers import AutoProcessor

    module, function = HAND_BUILT[model_type]
    model, _ = getattr(importlib.import_module(module), function)(folder)
    processor = AutoProcessor.from_pretrained(folder)
    tokens = modality_token_ids(model.config, processor, processor.tokenizer)
    for modality, (text, _number) in list(tokens.items()):
        for key in (f"{modality}_token_id", f"{modality}_token_index"):
            if isinstance(getattr(model.config, key, None), int):
                tokens[modality] = (text, getattr(model.config, key))
                break
    manifest = {"model_type": model_type, "model_class": type(model).__name__,
                "processor_class": type(processor).__name__, "tokens": tokens, "assigned_ids": {},
                "parameters": sum(p.numel() for p in model.parameters()), "hand_built": f"{module}.{function}"}
    (folder / "zoo.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def build(model_type: str, folder: Path, seed: int = 0) -> dict[str, Any]:
    """Build and save the folder; returns the manifest (also written to zoo.json)."""
    import transformers
    from transformers.models.auto import configuration_auto

    if model_type in HAND_BUILT:
        folder.mkdir(parents=True, exist_ok=True)
        return hand_built(model_type, folder)

    config_class = getattr(transformers, configuration_auto.CONFIG_MAPPING_NAMES[model_type])
    try:
        config = shrink.tiny_config(config_class, config_extra(model_type))
    except Exception as exc:  # noqa: BLE001
        raise Unbuildable(f"config: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from None
    processor, tokenizer = build_processor(model_type, config)
    assigned = align_token_ids(config, processor, tokenizer)
    set_vocabulary_map(config, tokenizer)
    tokens = modality_token_ids(config, processor, tokenizer)
    for modality, filled in FILLED_TOKENS.get(model_type, {}).items():
        number = tokenizer.get_vocab()[filled]
        names = (f"{modality}_token_id", f"{modality}_token_index")
        names += tuple(getattr(config, "attribute_map", {}).get(name) for name in names)  # Molmo2's image_patch_id
        for path in shrink.token_id_attributes(config):
            if path.rsplit(".", 1)[-1] in names:
                shrink.set_path(config, path, number)
                assigned[path] = number
        tokens[modality] = (tokens[modality][0], number)
    set_dtype(config, torch.float32)
    model_class = getattr(transformers, MODEL_CLASS_OVERRIDES.get(model_type) or model_class_name(model_type))
    torch.manual_seed(seed)
    try:
        model = model_class(config).eval()
    except Exception as exc:  # noqa: BLE001
        raise Unbuildable(f"{model_class.__name__}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") \
            from None
    randomize_zero_weights(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    manifest = {"model_type": model_type, "model_class": model_class.__name__,
                "processor_class": type(processor).__name__, "tokens": tokens, "assigned_ids": assigned,
                "parameters": sum(p.numel() for p in model.parameters())}
    (folder / "zoo.json").write_text(json.dumps(manifest, indent=1))
    return manifest
