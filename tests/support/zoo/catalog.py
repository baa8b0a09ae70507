"""Which model types the zoo covers, which are not applicable (and why), and the per-type build overrides.

The types are the keys of transformers' image-text-to-text and multimodal-LM auto mappings. A type is "not
applicable" when its model is not a decoder language model fed with encoder rows spliced into `inputs_embeds`
at placeholder-token positions (what encode-server produces); each reason below was decided by reading the
type's modeling code in transformers 5.23.
"""

from __future__ import annotations

from typing import Any

NOT_APPLICABLE: dict[str, str] = {
    "blip": "text decoder cross-attends to the image embeddings (no placeholder splice)",
    "git": "image features are concatenated in front of the text embeddings inside GitModel, no placeholder token",
    "idefics": "gated cross-attention layers read the image features (no splice into inputs_embeds)",
    "mllama": "cross-attention layers read the image features (no splice into inputs_embeds)",
    "pi0": "a robot action policy (flow-matching action expert), not a language model fed with spliced rows",
    "pix2struct": "encoder-decoder: image patches are the encoder's input",
    "florence2": "encoder-decoder (BART): image features are concatenated into the encoder's input",
    "udop": "encoder-decoder (T5) with layout embeddings",
    "vision-encoder-decoder": "encoder-decoder: the image encoder's output is the decoder's cross-attention memory",
    "pp_formulanet": "encoder-decoder: the decoder cross-attends to the image encoder",
    "t5gemma2": "encoder-decoder: image rows are spliced into the encoder's input, not a decoder LM's prefill",
    "kosmos-2": "image rows are placed by image_embeds_position_mask inside the text model, no placeholder token id",
    "kosmos-2.5": "image rows are placed by image_embeds_position_mask inside the text model, no placeholder token id",
    "evolla": "protein sequences (cross-attention to a protein encoder), no image or audio",
    "kyutai_speech_to_text": ("streaming: audio codec tokens are embedded and summed at every text "
                              "position, no placeholder"),
    "voxtral_realtime": "streaming: audio embeddings are added to every text position (inputs_embeds += audio_embeds)",
    "mistral4": "the mapped class (Mistral4ForCausalLM) is text-only: no image or audio input",
}

#: Types whose auto mapping names no processor: the processor class their Hub folders ship.
PROCESSOR_OVERRIDES: dict[str, str] = {
    "qwen2_5_omni_thinker": "Qwen2_5OmniProcessor",
    "qwen3_omni_moe_thinker": "Qwen3OmniMoeProcessor",
    "glm_ocr": "Glm46VProcessor",
    "glmga": "Glm46VProcessor",
    "fast_vlm": "LlavaProcessor",
    "cosmos3_omni": "Qwen2_5_VLProcessor",
}

MODEL_CLASS_OVERRIDES: dict[str, str] = {}

#: Types whose config the generic shrink cannot make valid (per-layer tables, architecture validators): the
#: test suite's hand-built tiny checkpoint of the same kind (save_pretrained, its processor, an offline
#: tokenizer), as (module, function taking the folder).
HAND_BUILT: dict[str, tuple[str, str]] = {
    "dots3_note": ("tests.support.checkpoints.dots3_note", "dots3_note_checkpoint"),
    "muse_spark": ("tests.support.checkpoints.muse_spark", "muse_spark_checkpoint"),
    # a `mistral_common` tokenizer (tekken.json) that writes the audio tokens of a chat request
    "voxtral": ("tests.support.checkpoints.voxtral", "voxtral_checkpoint"),
}

#: Chat templates a Hub folder ships that the processor cannot run without ({BOI}: the processor's boi_token).
#: ShieldGemma 2 builds one prompt per policy from its template: the image, then the policy's text.
CHAT_TEMPLATES: dict[str, str] = {
    "shieldgemma2": ("{% for message in messages %}{% for content in message['content'] %}"
                     "{% if content['type'] == 'image' %}{BOI}{% else %}{{ content['text'] }}{% endif %}"
                     "{% endfor %}{% endfor %}"),
}

#: Processor settings a Hub folder's processor_config.json holds where the class default disagrees with the model:
#: Pixtral-style processors default to patches of 16 unmerged, Mistral 3's tower uses 14, merged 2x2.
_PIXTRAL = {"patch_size": 14, "spatial_merge_size": 2}
PROCESSOR_SETTINGS: dict[str, dict[str, Any]] = {"mistral3": _PIXTRAL, "mistral_large4": _PIXTRAL,
                                                 "fast_vlm": {"patch_size": 64},  # FastViT downsamples 64x
                                                 # its CLIP tower's class token is counted, then dropped
                                                 "vipllava": {"vision_feature_select_strategy": "default"}}
#: Image processor attributes a Hub folder's preprocessor_config.json holds (PaliGemma's processor reads its
#: row count there: (224 / 14)^2).
IMAGE_PROCESSOR_SETTINGS: dict[str, dict[str, Any]] = {
    "paligemma": {"image_seq_length": 256},
    "fast_vlm": {"size": {"shortest_edge": 1024}, "crop_size": {"height": 1024, "width": 1024}},
}

#: Types whose rows fill another token than the one a prompt holds (and the processor names `image_token`): the
#: token the config's placeholder id must name, as the Hub folder's config does (Llama 4 expands <|image|> into
#: <|patch|> tokens, and its `image_token_index` is <|patch|>'s id; Molmo2 expands <|image|> and <|video|> into
#: <im_patch> tokens, its `image_patch_id`).
FILLED_TOKENS: dict[str, dict[str, str]] = {"llama4": {"image": "<|patch|>"}, "aya_vision": {"image": "<|IMG_PATCH|>"},
                                            "ovis2": {"image": "<IMG_ATOM>"},
                                            "molmo2": {"image": "<im_patch>", "video": "<im_patch>"}}

#: Per-type config overrides (nested dicts), on top of the generic shrink.
_GLM_TEXT = {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}}}
#: Gemma 3's SigLIP at 224 pixels, patches of 14 average-pooled to 4x4 (its default tower, 224/16, cannot pool).
_GEMMA3 = {"vision_config": {"image_size": 224, "patch_size": 14}, "mm_tokens_per_image": 16}
#: Qwen2-VL-style text models read a default mrope section [16, 24, 24] the shrink must rescale.
_QWEN_MROPE = {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                   "mrope_section": [16, 24, 24]}}}


def _omni_rope(section: list[int]) -> dict[str, Any]:
    return {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                                "mrope_section": section}}}


CONFIG_EXTRA: dict[str, dict[str, Any]] = {
    "glm4v": _GLM_TEXT, "glm4v_moe": _GLM_TEXT, "glm46v": _GLM_TEXT, "glm_ocr": _GLM_TEXT, "glmga": _GLM_TEXT,
    "gemma3": _GEMMA3, "shieldgemma2": _GEMMA3,
    # Idefics3's published tower: 364 pixels in patches of 14, pixel-shuffled 2x2 (its default, 224/32, cannot)
    # Qwen2-VL's tower names its output width `hidden_size` (the text's); its defaults disagree (3584 vs 8192)
    "qwen2_vl": {"vision_config": {"hidden_size": "TEXT_HIDDEN"}, **_QWEN_MROPE},
    "qwen2_5_vl": _QWEN_MROPE,
    # the thinker only: the talker and its speaker files are not part of what encode-server serves
    # (a Hub folder's thinker config names its vision-start id, which its rope index reads; the class has no default)
    # and its text config the mrope section the modeling code defaults to, rescaled by the shrink)
    "qwen2_5_omni": {"enable_audio_output": False, "thinker_config": {"vision_start_token_id": 151652,
                                                                      **_omni_rope([16, 24, 24])}},
    "qwen3_omni_moe": {"enable_audio_output": False, "thinker_config": {"vision_start_token_id": 151652,
                                                                        **_omni_rope([24, 20, 20])}},
    "qwen2_5_omni_thinker": {"vision_start_token_id": 151652, **_omni_rope([16, 24, 24])},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652, **_omni_rope([24, 20, 20])},
    "idefics3": {"vision_config": {"image_size": 364, "patch_size": 14}},
    # Janus' aligner ends at projection_dim, the text width in a published config (its defaults disagree)
    "janus": {"vision_config": {"projection_dim": "TEXT_HIDDEN"}, "vq_config": {"projection_dim": "TEXT_HIDDEN"}},
    "ovis2": {"hidden_size": "TEXT_HIDDEN"},  # its visual embedding table is as wide as the text's
    # Phi-4's conformer convolutions run at the encoder width
    "phi4_multimodal": {"audio_config": {"depthwise_separable_out_channel": 64, "ext_pw_out_channel": 64,
                                         "nemo_conv_channels": 64}},
    # towers whose feature layers index deep: their default depth (VipLLaVA reads layers -2, -5, -8, -11 and 6;
    # DeepSeek-VL Hybrid's SAM tower its global-attention layer 2)
    "vipllava": {"vision_config": {"num_hidden_layers": 12}},
    "deepseek_vl_hybrid": {"high_res_vision_config": {"num_hidden_layers": 12}},
    "fast_vlm": {"vision_config": {"hidden_size": 3072}},  # its timm FastViT-MCi3 gives 3072 channels
    "step3p7": {"text_config": {"sliding_window": 512}},  # its attention asks for one even with full layers
    "paddleocr_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                                         "mrope_section": [16, 24, 24]}}},
    # image codes become tokens of the text vocabulary: a codebook small enough to fit it
    # (and VQ encoders of few channels: their published widths make a model of a gigabyte)
    "chameleon": {"vq_config": {"num_embeddings": 64, "base_channels": 32, "num_res_blocks": 1}},
    "emu3": {"vq_config": {"codebook_size": 64, "base_channels": 32, "num_res_blocks": 1,
                          "hidden_size": 128}},  # its attention width, base_channels * 4
    # Cohere Compass keys its rope parameters by layer type (its defaults leave them empty)
    "cohere_compass": {"text_config": {"head_dim": 32, "rope_parameters": {"full_attention": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]}}}},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},  # its defaults leave it None
    # settings the config's validators tie to widths, depths or the vocabulary, set for the tiny shape
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},  # its two last tower layers ([24, 18])
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 20}},  # the text width (80) // 4
    "nemo_speechlm": {"word_timestamp_config": {"blank_token_id": 319}},  # the last class of the tiny vocabulary
    # their LM heads are as wide as the unpadded vocabulary, which their defaults keep at the published 200058
    "inkling2": {"text_config": {"unpadded_vocab_size": 320}},
    "inkling2_loop": {"text_config": {"unpadded_vocab_size": 320}},
    # its defaults leave the head size and the multimodal rope axes None (published: xdrope_section [16]*4 of a
    # head of 128, four axes; rescaled to the tiny head by the shrink)
    "hunyuan_vl": {"text_config": {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [16, 16, 16, 16]}}},
    "aya_vision": {"vision_config": {"image_size": 364}},  # its processor's 364-pixel tiles (img_size)
    "smolvlm": {"vision_config": {"image_size": 364, "patch_size": 14}},  # its processor's 364-pixel tiles, 169 rows
    # Gemma 3n shares its last layers' key/value caches: four layers, the last two reading the first two's
    "gemma3n": {"text_config": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                                "layer_types": ["sliding_attention", "full_attention"] * 2,
                                "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0],
                                "vocab_size_per_layer_input": 64},
                # its timm MobileNetV5 tower is fixed (2048 channels out); the vision and audio vocabularies
                # (128 each) end the text one (320), as 262144 + 128 + 128 do in the published config
                "vision_config": {"hidden_size": 2048, "vocab_offset": 64},
                "audio_config": {"vocab_offset": 192}},
    # Llama 4's pixel shuffle (ratio 0.5) makes 4x the tower width (`intermediate_size`), its MLP maps that to
    # projector_input_dim = projector_output_dim = vision_output_dim, what the projector reads
    "llama4": {"vision_config": {"hidden_size": 64, "intermediate_size": 256, "projector_input_dim": 96,
                                 "projector_output_dim": 96, "vision_output_dim": 96}},
}


def model_types() -> list[str]:
    from transformers.models.auto import modeling_auto

    return list(dict.fromkeys([*modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                               *modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES]))


def model_class_name(model_type: str) -> str:
    from transformers.models.auto import modeling_auto

    return (modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.get(model_type)
            or modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])


def processor_class_name(model_type: str) -> str | None:
    from transformers.models.auto import processing_auto

    return PROCESSOR_OVERRIDES.get(model_type) or processing_auto.PROCESSOR_MAPPING_NAMES.get(model_type)


def config_extra(model_type: str) -> dict[str, Any]:
    return CONFIG_EXTRA.get(model_type, {})
