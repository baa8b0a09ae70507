"""Muse Spark's processor: images and video frames resized (aspect kept) into a budget of merged tokens
(`smart_resize` of Muse Glimmer's image processor) through its own torchvision-backed processors, videos in
temporal clips of `temporal_patch_size` frames; audio waveforms padded to whole `samples_per_token` rows by its
feature extractor, a batch padded with zeros to the longest clip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from processors.base import ItemError, ItemLayout, PreparedBatch, Processor

MODALITIES = ("image", "video", "audio")


class MuseSparkProcessor(Processor):
    """Images, videos and waveforms through Muse Spark's own processors and feature extractor."""

    modalities = MODALITIES

    def __init__(self, image_processor: Any, video_processor: Any, feature_extractor: Any) -> None:
        self.patch_size, self.merge_size = int(image_processor.patch_size), int(image_processor.merge_size)
        self.temporal_patch_size = int(image_processor.temporal_patch_size)
        self.image_processor, self.video_processor = image_processor, video_processor
        self.max_image_tokens = int(image_processor.max_image_tokens)
        self.max_frame_tokens = int(video_processor.max_video_frame_tokens)
        self.samples_per_token = int(feature_extractor.samples_per_token)
        self.feature_extractor = feature_extractor
        self.sampling_rate = int(feature_extractor.sampling_rate)

    def sample_item(self) -> tuple[str, Any]:
        return "image", Image.new("RGB", (64, 48), (128, 128, 128))

    # --- layouts ---------------------------------------------------------------------------------

    def _patches(self, width: int, height: int, max_tokens: int) -> tuple[int, int]:
        """The merged-token grid `(ph, pw)` the processors resize an image or frame of this size to."""
        from transformers.models.muse_glimmer.image_processing_muse_glimmer import smart_resize

        block = self.patch_size * self.merge_size
        resized_h, resized_w = smart_resize(height=height, width=width, patch_size=block, max_tokens=max_tokens)
        return resized_h // block, resized_w // block

    def _vision_layout(self, clips: int | None, ph: int, pw: int) -> ItemLayout:
        """An image (`clips` None) or a video of `clips` temporal clips, `ph x pw` merged tokens each."""
        m, t = self.merge_size, clips or 1
        frames = None if clips is None else tuple(float(k * self.temporal_patch_size) for k in range(clips))
        return ItemLayout(tokens=t * ph * pw, grid_thw=(t, ph * m, pw * m), receiver_grid=(t, ph, pw),
                          clip_frames=frames)

    def _audio_layout(self, samples: int) -> ItemLayout:
        rows = -(-samples // self.samples_per_token)
        return ItemLayout(tokens=rows, grid_thw=(1, 1, rows), receiver_grid=rows)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "audio":
            if not isinstance(item, np.ndarray) or item.ndim != 1:
                raise ItemError("expected a mono waveform")
            if item.shape[0] == 0:
                raise ItemError("audio of 0 samples yields no embedding: send a clip that holds samples")
            return self._audio_layout(int(item.shape[0]))
        if modality == "video":
            frames = check_frames(item)
            ph, pw = self._patches(*frames[0].size, self.max_frame_tokens)
            return self._vision_layout(-(-len(frames) // self.temporal_patch_size), ph, pw)
        if not isinstance(item, Image.Image):
            raise ItemError(f"expected an image, got {type(item).__name__}")
        return self._vision_layout(None, *self._patches(*item.size, self.max_image_tokens))

    # --- preprocessing ---------------------------------------------------------------------------

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality == "audio":
            features = self.feature_extractor(list(items), sampling_rate=self.sampling_rate, padding="longest",
                                              return_attention_mask=True, return_tensors="pt")
            samples = features["input_values_mask"].sum(-1)
            return PreparedBatch(modality=modality, layouts=[self._audio_layout(int(n)) for n in samples],
                                 inputs={"input_values": features["input_values"], "samples": samples})
        if modality == "video":
            videos = [check_frames(frames) for frames in items]
            processed = self.video_processor(videos=videos, do_sample_frames=False, return_tensors="pt")
            pixels, grid = processed["pixel_values_videos"], processed["video_grid_thw"]
        else:
            processed = self.image_processor(images=list(items), return_tensors="pt")
            pixels, grid = processed["pixel_values"], processed["image_grid_thw"]
        m = self.merge_size
        layouts = [self._vision_layout(t if modality == "video" else None, h // m, w // m)
                   for t, h, w in grid.tolist()]
        return PreparedBatch(modality=modality, layouts=layouts, inputs={"pixel_values": pixels, "grid_thw": grid})

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Audio clips are padded with zeros to the longest, as the feature extractor pads a batch."""
        if len(batches) < 2 or batches[0].modality != "audio":
            return super().collate(batches)
        length = max(batch.inputs["input_values"].shape[1] for batch in batches)
        values = torch.cat([torch.nn.functional.pad(batch.inputs["input_values"],
                                                    (0, length - batch.inputs["input_values"].shape[1]))
                            for batch in batches])
        return PreparedBatch(modality="audio", layouts=[layout for batch in batches for layout in batch.layouts],
                             inputs={"input_values": values,
                                     "samples": torch.cat([batch.inputs["samples"] for batch in batches])})


def check_frames(item: Any) -> list[Image.Image]:
    """A video as a non-empty list of frames of one size (the video processor stacks them), or an ItemError."""
    if not isinstance(item, list) or not item or not all(isinstance(frame, Image.Image) for frame in item):
        raise ItemError("expected a video as a non-empty list of frames")
    sizes = {frame.size for frame in item}
    if len(sizes) > 1:
        raise ItemError(f"video frames must all have one size, got {sorted(sizes)}: send the frames of one video "
                        "at one size")
    return item
