"""Shrink a transformers config to a tiny one of the same shape: widths, depths, heads, experts and vocabulary
made small, geometry (image size, patch size, merge sizes, mel bins, sampling) kept as the defaults have it.

Keeping the geometry means the default image processor and feature extractor stay consistent with the model
(same patch grid, same position-embedding table); only the work per token shrinks. Widths are remapped
consistently over the whole config tree (every width that equals the text hidden size stays equal to it), so
projector dimensions that must match keep matching.
"""

from __future__ import annotations

import copy
from typing import Any

#: Attributes holding a layer width (remapped by value, consistently over the tree).
WIDTH_KEYS = {"hidden_size", "d_model", "embed_dim", "hidden_dim", "out_hidden_size", "output_dim", "projection_dim",
              "proj_dim", "mm_hidden_size", "projector_hidden_size", "vision_hidden_size", "text_hidden_size",
              "encoder_hidden_size", "hidden_channels", "width", "embedding_dim", "n_embd", "dim", "vision_dim",
              "audio_hidden_size", "hidden_size_per_layer_input", "projector_dim", "output_hidden_size",
              "adapter_hidden_size", "encoder_dim", "llm_dim", "out_dim", "downsample_hidden_size",
              "vision_output_dim", "projector_output_dim", "text_dim", "audio_dim", "context_dim",
              "projection_hidden_size"}
#: Attributes holding a feed-forward width.
FFN_KEYS = {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "mlp_dim", "n_inner",
            "projector_intermediate_size", "intermediate_dim", "linear_units", "mlp_hidden_size",
            "feed_forward_dim", "ff_dim", "projector_ffn_dim"}
MOE_FFN_KEYS = {"moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                "moe_ffn_dim"}
LAYER_KEYS = {"num_hidden_layers", "depth", "encoder_layers", "decoder_layers", "num_layers", "n_layers",
              "num_encoder_layers", "num_decoder_layers", "n_layer", "vision_layers", "num_blocks"}
HEAD_KEYS = {"num_attention_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads", "n_heads",
             "n_head", "attention_heads"}
KV_HEAD_KEYS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "encoder_kv_heads"}
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts"}
TOPK_KEYS = {"num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token"}
SMALL_KEYS = {"n_group": 1, "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 16, "v_head_dim": 16, "n_shared_experts": 1, "num_shared_experts": 1,
              "linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16}
TOKEN_ID_SUFFIXES = ("_token_id", "_token_index", "_token_ids", "_id")

WIDTH_LADDER = (64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256, 272, 288)
DEPTH = 2
HEADS = 2
VOCAB = 320


def is_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def sub_config_names(config: Any) -> list[str]:
    return [name for name, value in vars(config).items() if is_config(value)]


def collect_widths(config: Any, found: set[int]) -> set[int]:
    for key, value in vars(config).items():
        if key in WIDTH_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.add(value)
        elif is_config(value):
            collect_widths(value, found)
    return found


def width_map(config: Any) -> dict[int, int]:
    """Old width -> new width, order kept (a wider layer stays wider), the text hidden size mapped to 64 or more."""
    widths = sorted(collect_widths(config, set()))
    if len(widths) > len(WIDTH_LADDER):
        widths = widths[-len(WIDTH_LADDER):]
    return dict(zip(widths, WIDTH_LADDER))


def scale_section(section: list[int], total: int) -> list[int]:
    """An mrope-style section (parts of half the head dim) rescaled to sum to `total`, each part even-ish."""
    old = sum(section)
    new = [max(1, round(part * total / old)) for part in section]
    new[-1] += total - sum(new)
    return new


def composite_defaults(value: Any) -> dict[str, Any]:
    """The settings where a composite config's default sub-config differs from the sub-config class's own defaults
    (a LLaVA's CLIP tower at 336 pixels, not CLIP's 224): they must survive rebuilding the sub-config from a dict."""
    try:
        plain = type(value)().to_dict()
    except Exception:  # noqa: BLE001 (a class without usable defaults: keep everything)
        return value.to_dict()
    return {key: item for key, item in value.to_dict().items()
            if key not in plain or plain[key] != item and not is_config(getattr(value, key, None))}


def shrink_overrides(config: Any, widths: dict[int, int]) -> dict[str, Any]:
    """The keyword arguments that rebuild this (sub-)config small; sub-configs nested as dicts with their type."""
    out: dict[str, Any] = {}
    attrs = vars(config)
    for key, value in attrs.items():
        if is_config(value):
            nested = shrink_overrides(value, widths)
            nested["model_type"] = value.model_type
            out[key] = {**composite_defaults(value), **nested}
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if key in WIDTH_KEYS and value in widths:
            out[key] = widths[value]
        elif key in FFN_KEYS and value > 0:
            out[key] = 96
        elif key in MOE_FFN_KEYS and value > 0:
            out[key] = 32
        elif key in LAYER_KEYS and value > 0:
            out[key] = min(value, DEPTH)
        elif key in HEAD_KEYS and value > 0:
            out[key] = min(value, HEADS)
        elif key in KV_HEAD_KEYS and value > 0:
            out[key] = 1
        elif key in EXPERT_KEYS and value > 0:
            out[key] = min(value, 4)
        elif key in TOPK_KEYS and value > 0:
            out[key] = min(value, 2)
        elif key in SMALL_KEYS and value > 0:
            out[key] = min(value, SMALL_KEYS[key])
        elif key == "vocab_size" and value > VOCAB:
            out[key] = VOCAB
    hidden = out.get("hidden_size", attrs.get("hidden_size"))
    heads = out.get("num_attention_heads", out.get("num_heads", attrs.get("num_attention_heads")))
    if isinstance(attrs.get("head_dim"), int) and isinstance(hidden, int) and isinstance(heads, int) and heads:
        out["head_dim"] = max(16, hidden // heads)
        if isinstance(attrs.get("qk_rope_head_dim"), int) and attrs["head_dim"] == attrs["qk_rope_head_dim"]:
            # multi-head latent attention: the rotary part's width
            out["head_dim"] = out.get("qk_rope_head_dim", attrs["qk_rope_head_dim"])
    if isinstance(attrs.get("kv_lora_rank"), int) and attrs.get("num_key_value_heads") == attrs.get(
            "num_attention_heads") and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # latent attention: as many key heads as queries
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(attrs.get(key), dict) and isinstance(attrs[key].get("mrope_section"), list):
            out[key] = copy.deepcopy(attrs[key])
    out["_defaults"] = {"hidden_size": attrs.get("hidden_size"), "head_dim": attrs.get("head_dim"),
                        "partial_rotary_factor": attrs.get("partial_rotary_factor")}
    depth = out.get("depth", out.get("num_hidden_layers"))
    for key in ("deepstack_visual_indexes", "fullatt_block_indexes", "out_indices", "intermediate_layers_indices"):
        value = attrs.get(key)
        if isinstance(value, list) and depth and value and any(v >= depth for v in value if isinstance(v, int)):
            out[key] = list(range(min(len(value), depth)))
    if "layer_types" in attrs and isinstance(attrs["layer_types"], list) and "num_hidden_layers" in out:
        kinds = list(dict.fromkeys(attrs["layer_types"]))
        n = out["num_hidden_layers"]
        out["layer_types"] = [kinds[i % len(kinds)] for i in range(n)] if len(kinds) > 1 else [kinds[0]] * n
    for key in ("mlp_only_layers", "decoder_sparse_step"):
        if key == "mlp_only_layers" and isinstance(attrs.get(key), list) and attrs[key]:
            out[key] = []
    if isinstance(attrs.get("first_k_dense_replace"), int) and attrs["first_k_dense_replace"] > 1:
        out["first_k_dense_replace"] = 1
    return out


def fix_mrope(overrides: dict[str, Any]) -> None:
    """Every mrope section rescaled to the shrunk head size (it splits half the rotary dims by axis)."""
    defaults = overrides.pop("_defaults", {})
    for value in overrides.values():
        if isinstance(value, dict):
            fix_mrope(value)
    hidden = overrides.get("hidden_size", defaults.get("hidden_size"))
    heads = overrides.get("num_attention_heads", overrides.get("num_heads"))
    head_dim = overrides.get("head_dim") or defaults.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
    for key in ("rope_parameters", "rope_scaling"):
        rope = overrides.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and head_dim:
            partial = float(rope.get("partial_rotary_factor") or overrides.get("partial_rotary_factor")
                            or defaults.get("partial_rotary_factor") or 1.0)
            rope["mrope_section"] = scale_section(rope["mrope_section"], int(head_dim * partial) // 2)


def nested_update(base: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            nested_update(base[key], value)
        else:
            base[key] = value
    return base


#: Widths of a tower's output that its language model takes as they are: the text hidden size.
TO_TEXT_KEYS = {"output_dim", "out_hidden_size", "text_hidden_size", "llm_dim", "output_hidden_size",
                "projector_output_dim"}


def text_hidden(config: Any) -> int | None:
    for holder in (config, getattr(config, "thinker_config", None)):
        text = getattr(holder, "text_config", None)
        if text is not None and isinstance(getattr(text, "hidden_size", None), int):
            return text.hidden_size
    return getattr(config, "hidden_size", None) if isinstance(getattr(config, "hidden_size", None), int) else None


def outputs_to_text(overrides: dict[str, Any], hidden: int, is_text: bool = False) -> None:
    for key, value in overrides.items():
        if isinstance(value, dict):
            outputs_to_text(value, hidden, key == "text_config")
        elif key in TO_TEXT_KEYS and not is_text or value == "TEXT_HIDDEN":
            overrides[key] = hidden


def with_optional_towers(config_class: type) -> Any:
    """The config's defaults, with every sub-config the defaults leave out (Gemma 4's vision and audio towers are
    optional, None by default) present at its own class's defaults, as a published checkpoint has them."""
    default = config_class()
    missing = {name: klass() for name, klass in (getattr(config_class, "sub_configs", None) or {}).items()
               if isinstance(klass, type) and getattr(default, name, "absent") is None}
    return config_class(**missing) if missing else default


def tiny_config(config_class: type, extra: dict | None = None) -> Any:
    """The config class's defaults, shrunk, with `extra` (per-type overrides, nested dicts) on top."""
    default = with_optional_towers(config_class)
    widths = width_map(default)
    overrides = shrink_overrides(default, widths)
    if extra:
        nested_update(overrides, copy.deepcopy(extra))
    hidden = text_hidden(default)
    if hidden in widths:
        outputs_to_text(overrides, widths[hidden])
    fix_mrope(overrides)
    return config_class(**overrides)


def is_ids(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, int) and not isinstance(value, bool)


def token_id_attributes(config: Any, prefix: str = "") -> dict[str, Any]:
    """Every `*_token_id` / `*_token_index` / `*_id` attribute over the tree, by dotted path."""
    out = {}
    for key, value in vars(config).items():
        if is_config(value):
            out.update(token_id_attributes(value, f"{prefix}{key}."))
        elif key.endswith(TOKEN_ID_SUFFIXES) and is_ids(value):
            out[prefix + key] = value
    return out


def set_path(config: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for name in parents:
        config = getattr(config, name)
    setattr(config, last, value)
