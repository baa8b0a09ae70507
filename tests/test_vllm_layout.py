"""Where vLLM 0.33 lays rows out otherwise than transformers: the vLLM producer refuses such checkpoints
at start-up rather than write rows a consumer would reject (`vllm_producer.check_vllm_layout`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from encode_server.vllm_producer import check_vllm_layout

pytestmark = pytest.mark.quick


def adapter(family: str, ratio: str | None):
    config = SimpleNamespace(vision_aspect_ratio=ratio) if ratio else SimpleNamespace()
    return SimpleNamespace(info=SimpleNamespace(family=family), model=SimpleNamespace(config=config))


def test_llava_onevision_needs_the_aspect_ratio_vllm_assumes():
    check_vllm_layout(adapter("llava_onevision", "anyres_max_9"))
    with pytest.raises(ValueError, match="anyres_max_9.*--ec-storage|--ec-storage.*anyres_max_9"):
        check_vllm_layout(adapter("llava_onevision", "anyres_max_2"))


def test_other_families_are_not_concerned():
    check_vllm_layout(adapter("qwen2_5_vl", None))
    check_vllm_layout(adapter("qwen3_vl", "anything"))
