"""Qwen2-VL's and GLM-4V's image processors with a faster, bit-identical rescale + normalise + patchify.

`Qwen2VLImageProcessorPil` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 checkpoints) and
`Glm4vImageProcessorPil` (the same steps, its own resize) resize each image (PIL, uint8), then
rescale it in float64, cast to float32, normalise it in float32 and patchify it:
four passes over a float image and a final copy, most of a large image's preprocessing. After the
resize every output value depends only on the pixel's uint8 value and its channel, so a 256-entry
table per channel, computed with the very same numpy operations, gives the identical float32 bits in
one gather, done after patchifying the uint8 image (a byte per value to move, not four) straight into
the patch layout.

Their torchvision-backend twins (`Qwen2VLImageProcessor`, `Glm4vImageProcessor`: what `AutoImageProcessor`
picks for a checkpoint folder where torchvision is installed) resize with torchvision (uint8 in, uint8
out), cast to float32, normalise with the rescale folded into the mean and std, patchify with an expanding
copy and concatenate the batch. Their twins cut the uint8 image into patches first and normalise the patches
with the processor's own `rescale_and_normalize` (element-wise: the same bits), writing each image's rows
straight into the batch's one pixel tensor: no float image is patchified, and nothing is concatenated.

Only the step after the resize changes: `preprocess`, its argument handling, RGB conversion and the
resize itself stay `transformers`' own. An image that is not uint8 after the resize (a float array
given directly) takes the stock path. `accelerated` gives a copy of an exact stock instance the
twin's class (a subclass may change any step, so it is left alone) and returns anything else as it
is. tests/processors/test_fast_patches.py compares every output bit with the installed `transformers`.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch
from transformers.image_processing_utils import BatchFeature
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

try:  # the torchvision backend: importable where torchvision is installed
    from transformers.image_transforms import group_images_by_shape, reorder_images
    from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
except ImportError:  # pragma: no cover - depends on the environment
    Glm4vImageProcessor = Qwen2VLImageProcessor = None

from processors.base import PIXELS_ALLOCATOR, new_pixels


@functools.lru_cache(maxsize=16)
def value_table(channels: int, scale: float | None, mean: tuple[float, ...] | None,
                std: tuple[float, ...] | None) -> np.ndarray:
    """`[channels, 256]` float32: what `transformers`' `rescale` (float64, then float32) and `normalize`
    (float32) make of each uint8 value in each channel; `None` skips that step, as the processor does."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 256))
    if scale is not None:
        table = (values.astype(np.float64) * scale).astype(np.float32)  # transformers.image_transforms.rescale
    else:
        table = values.astype(np.float32)
    if mean is not None and std is not None:  # transformers.image_transforms.normalize, channels first
        table = ((table.T - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32)).T
    return np.ascontiguousarray(table, dtype=np.float32)


def _per_channel(value: Any, channels: int) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple, np.ndarray)):
        return (float(value),) * channels
    values = tuple(float(v) for v in value)
    if len(values) != channels:
        raise ValueError(f"expected {channels} values per channel, got {len(values)}")
    return values


def patchify_into(out: np.ndarray, image: np.ndarray, table: np.ndarray, patch_size: int, merge_size: int,
                  temporal_patch_size: int) -> None:
    """Write the patches of a uint8 `[C, H, W]` image, each value looked up in `table`, into `out`
    (`[rows, C * temporal * patch * patch]` float32), in `Qwen2VLImageProcessorPil.patchify`'s order."""
    channels, height, width = image.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    # (C, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, C, p, p): patchify's order, on uint8.
    patches = image.reshape(channels, grid_h // merge_size, merge_size, patch_size,
                            grid_w // merge_size, merge_size, patch_size).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.ascontiguousarray(patches).reshape(grid_h * grid_w, channels, patch_size * patch_size)
    target = out.reshape(grid_h * grid_w, channels, temporal_patch_size, patch_size * patch_size)
    for channel in range(channels):
        values = table[channel][patches[:, channel]]
        for step in range(temporal_patch_size):  # the image repeated over the temporal patch
            target[:, channel, step] = values


class TableLookupPatches:
    """The shared `_preprocess` of the PIL image processors that resize, rescale, normalise and patchify
    each image in Qwen2-VL's layout; a subclass says how its processor calls `resize`."""

    def _resize_for_patches(self, image: np.ndarray, size: Any, resample: Any, patch_size: int, merge_size: int,
                            temporal_patch_size: int) -> np.ndarray:
        raise NotImplementedError

    def _preprocess(self, images: list[np.ndarray], do_resize: bool, size: Any, resample: Any, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean: Any, image_std: Any, patch_size: int,
                    temporal_patch_size: int, merge_size: int, return_tensors: Any, **kwargs: Any) -> BatchFeature:
        resized = [self._resize_for_patches(image, size, resample, patch_size, merge_size, temporal_patch_size)
                   if do_resize else image for image in images]
        grids = [(1, image.shape[-2] // patch_size, image.shape[-1] // patch_size) for image in resized]
        rows = [h * w for _, h, w in grids]
        channels = resized[0].shape[0] if resized else 3
        # A new torch tensor (huge pages with THP_MEM_ALLOC_ENABLE=1) or the caller's (`pixels_allocated_by`:
        # a preprocessing worker's shared-memory slot); numpy writes through a view.
        shape = (sum(rows), channels * temporal_patch_size * patch_size * patch_size)
        pixels = (PIXELS_ALLOCATOR.get() or new_pixels)(shape).numpy()
        start = 0
        for image, count in zip(resized, rows):
            out = pixels[start:start + count]
            if image.dtype == np.uint8 and image.ndim == 3 and image.shape[0] == channels:
                table = value_table(channels, float(rescale_factor) if do_rescale else None,
                                    _per_channel(image_mean, channels) if do_normalize else None,
                                    _per_channel(image_std, channels) if do_normalize else None)
                patchify_into(out, image, table, patch_size, merge_size, temporal_patch_size)
            else:
                if do_rescale:
                    image = self.rescale(image, rescale_factor)
                if do_normalize:
                    image = self.normalize(image, image_mean, image_std)
                out[...] = self.patchify(image, patch_size=patch_size, merge_size=merge_size,
                                         temporal_patch_size=temporal_patch_size)[0]
            start += count
        return BatchFeature(data={"pixel_values": pixels, "image_grid_thw": np.array(grids, dtype=np.int64)},
                            tensor_type=return_tensors)


class FastQwen2VLImageProcessorPil(TableLookupPatches, Qwen2VLImageProcessorPil):
    """`Qwen2VLImageProcessorPil` whose step after the resize is a table lookup (same output bits)."""

    def _resize_for_patches(self, image, size, resample, patch_size, merge_size, temporal_patch_size):
        return self.resize(image, size=size, resample=resample, factor=patch_size * merge_size)


class FastGlm4vImageProcessorPil(TableLookupPatches, Glm4vImageProcessorPil):
    """`Glm4vImageProcessorPil` (its resize counts the temporal patch) with the table lookup."""

    def _resize_for_patches(self, image, size, resample, patch_size, merge_size, temporal_patch_size):
        return self.resize(image, size=size, resample=resample, factor=patch_size * merge_size,
                           temporal_factor=temporal_patch_size)


class TorchPatchesFirst:
    """The shared `_preprocess` of the torchvision-backend processors that resize, rescale + normalise and
    patchify each image in Qwen2-VL's layout; a subclass says how its processor calls `resize`.

    Each resized uint8 image is cut into its patches first (a byte per value to move), then put through the
    processor's own `rescale_and_normalize`, the patches standing for a batch of `patch x patch` images
    (element-wise per channel: the same float32 operations on the same values, so the same bits), and written
    into its rows of the batch's one pixel tensor, repeated over the temporal patch. Images that are not uint8
    on the CPU (a `device=` call, float tensors), or a call that neither rescales nor normalises (the pixels
    stay uint8), take the stock path."""

    def _resize_for_patches(self, images: torch.Tensor, size: Any, resample: Any, patch_size: int, merge_size: int,
                            temporal_patch_size: int) -> torch.Tensor:
        raise NotImplementedError

    def _preprocess(self, images: list[torch.Tensor], do_resize: bool, size: Any, resample: Any, do_rescale: bool,
                    rescale_factor: float, do_normalize: bool, image_mean: Any, image_std: Any, patch_size: int,
                    temporal_patch_size: int, merge_size: int, disable_grouping: bool | None, return_tensors: Any,
                    **kwargs: Any) -> BatchFeature:
        def stock() -> BatchFeature:
            return super(TorchPatchesFirst, self)._preprocess(
                images, do_resize, size, resample, do_rescale, rescale_factor, do_normalize, image_mean, image_std,
                patch_size, temporal_patch_size, merge_size, disable_grouping, return_tensors, **kwargs)

        if not (do_rescale or do_normalize) or not images or \
                any(image.device.type != "cpu" or image.dtype != torch.uint8 for image in images):
            return stock()
        grouped, index = group_images_by_shape(images, disable_grouping=disable_grouping)
        resized_grouped = {shape: self._resize_for_patches(stacked, size, resample, patch_size, merge_size,
                                                           temporal_patch_size) if do_resize else stacked
                           for shape, stacked in grouped.items()}
        resized = reorder_images(resized_grouped, index)
        channels = resized[0].shape[0]
        if any(image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != channels for image in resized):
            return stock()
        grids = [(1, image.shape[-2] // patch_size, image.shape[-1] // patch_size) for image in resized]
        rows = [h * w for _, h, w in grids]
        pixels = (PIXELS_ALLOCATOR.get() or new_pixels)((sum(rows), channels * temporal_patch_size * patch_size ** 2))
        start = 0
        for image, (_, grid_h, grid_w), count in zip(resized, grids, rows):
            # (C, gh/m, m, p, gw/m, m, p) -> (gh/m, gw/m, m, m, C, p, p): the stock patchify's order, on uint8.
            patches = image.reshape(channels, grid_h // merge_size, merge_size, patch_size, grid_w // merge_size,
                                    merge_size, patch_size).permute(1, 4, 2, 5, 0, 3, 6)
            patches = patches.reshape(count, channels, patch_size, patch_size)
            values = self.rescale_and_normalize(patches, do_rescale, rescale_factor, do_normalize, image_mean,
                                                image_std)
            target = pixels[start:start + count].view(count, channels, temporal_patch_size, patch_size, patch_size)
            target.copy_(values.unsqueeze(2).expand(-1, -1, temporal_patch_size, -1, -1))
            start += count
        return BatchFeature(data={"pixel_values": pixels, "image_grid_thw": torch.tensor(grids, dtype=torch.long)},
                            tensor_type=return_tensors)


#: Stock processor class -> its table-lookup twin.
FAST_TWINS = {Qwen2VLImageProcessorPil: FastQwen2VLImageProcessorPil,
              Glm4vImageProcessorPil: FastGlm4vImageProcessorPil}

if Qwen2VLImageProcessor is not None:
    class FastQwen2VLImageProcessor(TorchPatchesFirst, Qwen2VLImageProcessor):
        """`Qwen2VLImageProcessor` (torchvision) that patchifies before normalising (same bits, less to move)."""

        def _resize_for_patches(self, images, size, resample, patch_size, merge_size, temporal_patch_size):
            return self.resize(images=images, size=size, resample=resample, factor=patch_size * merge_size)

    class FastGlm4vImageProcessor(TorchPatchesFirst, Glm4vImageProcessor):
        """`Glm4vImageProcessor` (torchvision; its resize counts the temporal patch), patchifying first."""

        def _resize_for_patches(self, images, size, resample, patch_size, merge_size, temporal_patch_size):
            return self.resize(images=images, size=size, resample=resample, factor=patch_size * merge_size,
                               temporal_factor=temporal_patch_size)

    FAST_TWINS |= {Qwen2VLImageProcessor: FastQwen2VLImageProcessor, Glm4vImageProcessor: FastGlm4vImageProcessor}


def accelerated(processor: Any) -> Any:
    """A table-lookup copy of `processor` (same settings) if its class is exactly one of `FAST_TWINS`' stock
    classes; any other processor itself. The caller's object is never changed."""
    twin = FAST_TWINS.get(type(processor))
    if twin is None:
        return processor
    fast = copy.deepcopy(processor)
    fast.__class__ = twin
    return fast
