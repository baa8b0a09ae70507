"""Where vLLM 0.33 lays rows out otherwise than transformers: the vLLM producer refuses such checkpoints
at start-up rather than write rows a consumer would reject (`fronts.vllm.producer.check_vllm_layout`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from encode_server.fronts.vllm.producer import check_vllm_layout

pytestmark = pytest.mark.quick


def adapter(family: str, ratio: str | None):
    config = SimpleNamespace(vision_aspect_ratio=ratio) if ratio else SimpleNamespace()
    return SimpleNamespace(info=SimpleNamespace(family=family), model=SimpleNamespace(config=config))


def test_llava_onevision_needs_the_aspect_ratio_vllm_assumes():
    check_vllm_layout(adapter("llava_onevision", "anyres_max_9"))
    with pytest.raises(ValueError, match="anyres_max_9.*without a vLLM connector"):
        check_vllm_layout(adapter("llava_onevision", "anyres_max_2"))


def test_other_families_are_not_concerned():
    check_vllm_layout(adapter("qwen2_5_vl", None))
    check_vllm_layout(adapter("qwen3_vl", "anything"))


def test_modalities_vllm_lays_out_otherwise_are_refused_with_the_reason():
    from encode_server.fronts.vllm.producer import vllm_layout_refusal

    for family in ("kimi_k25", "muse_spark", "dots3_note"):
        reason = vllm_layout_refusal(family, "video")
        assert reason and "vLLM 0.33" in reason and "video_url" in reason
    for family, modality in (("qwen2_5_vl", "video"), ("qwen3_vl", "video"), ("qwen2_audio", "audio"),
                             ("qwen3_omni_moe", "audio"), ("kimi_k25", "image"), ("muse_spark", "audio")):
        assert vllm_layout_refusal(family, modality) is None


def test_video_loaders_vllm_has_of_its_own_are_refused():
    from encode_server.fronts.vllm.video import UnsupportedVideoLoader, loader_for

    for name in ("MiniMaxM3VLVideoProcessor", "MuseSparkVideoProcessor", "Glm46VVideoProcessor"):
        with pytest.raises(UnsupportedVideoLoader, match="does not implement"):
            loader_for(name)
