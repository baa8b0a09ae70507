"""The fast Qwen2-VL and GLM-4V image processors (`processors/fast_patches.py`: the PIL backend's table lookup,
the torchvision backend's patches-first normalisation) give the stock `transformers` processors' output bit for
bit."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

from encode_server.models import load_adapter
from processors.fast_patches import FAST_TWINS, accelerated

#: The stock classes of both backends (the torchvision one is what `AutoImageProcessor` picks for a folder here).
QWEN_BACKENDS = [Qwen2VLImageProcessorPil, Qwen2VLImageProcessor]

pytestmark = pytest.mark.quick

QWEN25_LIMITS = dict(min_pixels=3136, max_pixels=12845056)


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Noise over a gradient: every uint8 value shows up in every channel."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.ones((height, 1, 3))
    pixels = (ramp + rng.normal(0, 40, (height, width, 3))).clip(0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def assert_same_output(stock, images: list, return_tensors: str = "pt", **call) -> None:
    fast = accelerated(stock)
    assert type(fast) is FAST_TWINS[type(stock)]
    expected = stock(images=images, return_tensors=return_tensors, **call)
    got = fast(images=images, return_tensors=return_tensors, **call)
    for key in ("pixel_values", "image_grid_thw"):
        want, have = torch.as_tensor(np.asarray(expected[key])), torch.as_tensor(np.asarray(got[key]))
        assert want.dtype == have.dtype and want.shape == have.shape, key
        assert torch.equal(want, have), f"{key} differs in {(want != have).sum().item()} values"


@pytest.mark.parametrize("settings_", [
    dict(QWEN25_LIMITS),  # Qwen2-VL / Qwen2.5-VL
    dict(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=448 * 448),  # Qwen3-VL
    dict(QWEN25_LIMITS, image_mean=0.5, image_std=0.5),  # scalar mean and std
    dict(QWEN25_LIMITS, do_normalize=False),
    dict(QWEN25_LIMITS, do_rescale=False),
    dict(QWEN25_LIMITS, do_rescale=False, do_normalize=False),
    dict(QWEN25_LIMITS, temporal_patch_size=1),
    dict(min_pixels=56 * 56, max_pixels=112 * 112),  # large images shrink
])
@pytest.mark.parametrize("backend", QWEN_BACKENDS)
def test_bit_identical_for_each_setting(settings_, backend):
    images = [picture(301, 207, 1), picture(64, 40, 2), picture(640, 480, 3), picture(301, 207, 8)]
    assert_same_output(backend(**settings_), images)


@pytest.mark.parametrize("settings_", [
    {},  # GLM-4V's defaults
    dict(size={"shortest_edge": 56 * 56, "longest_edge": 448 * 448}),
    dict(do_normalize=False, temporal_patch_size=1),
])
@pytest.mark.parametrize("backend", [Glm4vImageProcessorPil, Glm4vImageProcessor])
def test_glm4v_bit_identical(settings_, backend):
    images = [picture(301, 207, 11), picture(64, 40, 12), picture(640, 480, 13)]
    assert_same_output(backend(**settings_), images)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "LA", "I;16"])
@pytest.mark.parametrize("backend", QWEN_BACKENDS)
def test_bit_identical_for_other_image_modes(mode, backend):
    assert_same_output(backend(**QWEN25_LIMITS), [picture(200, 150, 4, mode)])


@pytest.mark.parametrize("backend", QWEN_BACKENDS)
def test_numpy_return_and_a_camera_sized_image(backend):
    assert_same_output(backend(**QWEN25_LIMITS), [picture(1280, 720, 5)], return_tensors="np")


def test_torchvision_backend_takes_the_stock_path_where_pixels_stay_uint8_or_are_float():
    """Neither rescaled nor normalised, the stock output is uint8; float tensors are not a byte image: both
    take the stock steps, and give the stock output."""
    assert_same_output(Qwen2VLImageProcessor(**QWEN25_LIMITS, do_rescale=False, do_normalize=False),
                       [picture(90, 70, 9)])
    floats = torch.from_numpy(np.random.default_rng(10).random((3, 100, 130), dtype=np.float32))
    assert_same_output(Qwen2VLImageProcessor(**QWEN25_LIMITS), [floats, picture(90, 70, 7)], do_rescale=False)


def test_float_arrays_take_the_stock_path():
    """A float image (given as an array in 0..1) is not a table lookup: the stock steps run, same output."""
    image = np.random.default_rng(6).random((3, 100, 130), dtype=np.float32)
    assert_same_output(Qwen2VLImageProcessorPil(**QWEN25_LIMITS), [image, picture(90, 70, 7)],
                       do_rescale=False, input_data_format="channels_first")


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 700), height=st.integers(1, 700), seed=st.integers(0, 2**16),
       min_side=st.sampled_from([28, 56, 112]), max_side=st.sampled_from([224, 448, 3584]))
def test_bit_identical_for_any_size(width, height, seed, min_side, max_side):
    if max(width, height) / min(width, height) > 200:  # the processor refuses such aspect ratios
        return
    for backend in QWEN_BACKENDS:
        stock = backend(min_pixels=min_side * min_side, max_pixels=max_side * max_side)
        assert_same_output(stock, [picture(width, height, seed), picture(height, width, seed + 1)])


@pytest.mark.parametrize("backend", QWEN_BACKENDS)
def test_accelerated_copies_only_the_stock_class(backend):
    stock = backend(**QWEN25_LIMITS)
    fast = accelerated(stock)
    assert fast is not stock and type(stock) is backend  # the caller's object is unchanged
    assert fast.to_dict() | {"image_processor_type": None} == stock.to_dict() | {"image_processor_type": None}
    assert type(pickle.loads(pickle.dumps(fast))) is FAST_TWINS[backend]  # preprocessing workers

    class Custom(backend):
        pass

    custom = Custom()
    assert accelerated(custom) is custom


def test_the_qwen_and_glm4v_adapters_use_it():
    for name in ("tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-glm4v"):
        adapter = load_adapter(name, "cpu", "float32")
        assert type(adapter.processor.image_processor) in FAST_TWINS.values(), name


def test_gpu_preprocessing_finds_the_stock_class_behind_the_copy():
    """`--preprocess-device cuda` looks up the torchvision twin by the PIL class's module and name."""
    from encode_server.preprocessing.gpu import stock_class

    for stock in (Qwen2VLImageProcessorPil(), Glm4vImageProcessorPil()):
        assert stock_class(accelerated(stock)) is type(stock)


def test_gpu_preprocessing_keeps_a_torchvision_copy():
    """A folder's torchvision processor is its own GPU twin: the fast copy goes to the device as it is (its
    device calls take the stock steps)."""
    from encode_server.preprocessing.gpu import fast_twin

    fast = accelerated(Qwen2VLImageProcessor(**QWEN25_LIMITS))
    assert fast_twin(fast) is fast
