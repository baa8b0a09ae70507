"""Dots3-Note's processor: images and videos on the Qwen grid (`GridProcessor`: the folder's Qwen2-VL image
processor, its Qwen3-VL video processor's settings through `VideoPatcher`), and audio clips cut by
`Dots3NoteFeatureExtractor` into chunks of `chunk_length` seconds, each a log-mel spectrogram padded to the chunk
window; a chunk of `n` samples yields `ceil(n / samples_per_row)` rows, a clip the sum over its chunks (the
extractor's `num_audio_tokens`). Per-item audio batches are padded with zeros to the longest chunk's frames
when fused (the encoder masks every frame past a chunk's length)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from processors.base import ItemError, ItemLayout, PreparedBatch
from processors.grid import GridProcessor, qwen_image_size_of
from processors.video_patches import VideoPatcher

MODALITIES = ("image", "video", "audio")


def audio_rows(samples: int, chunk_samples: int, samples_per_row: int) -> int:
    """Rows of a clip of `samples` samples: each chunk of at most `chunk_samples` gives `ceil(n / samples_per_row)`."""
    full, rest = divmod(samples, chunk_samples)
    return full * -(-chunk_samples // samples_per_row) + -(-rest // samples_per_row)


class Dots3NoteProcessor(GridProcessor):
    """Images and videos as `GridProcessor` makes them; audio through the folder's feature extractor."""

    def __init__(self, image_processor: Any, video_processor: Any, feature_extractor: Any,
                 samples_per_row: int) -> None:
        super().__init__(image_processor, VideoPatcher(video_processor), qwen_image_size_of(image_processor),
                         modalities=MODALITIES)
        self.feature_extractor = feature_extractor
        self.sampling_rate = int(feature_extractor.sampling_rate)
        self.chunk_samples = int(feature_extractor.n_samples)
        self.samples_per_row = int(samples_per_row)

    def _audio_layout(self, rows: int) -> ItemLayout:
        return ItemLayout(tokens=rows, grid_thw=(1, 1, rows), receiver_grid=rows)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality != "audio":
            return super().item_layout(modality, item)
        if not isinstance(item, np.ndarray) or item.ndim != 1:
            raise ItemError("expected a mono waveform")
        if item.shape[0] == 0:
            raise ItemError("audio of 0 samples yields no embedding: send a clip that holds samples")
        return self._audio_layout(audio_rows(int(item.shape[0]), self.chunk_samples, self.samples_per_row))

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality != "audio":
            return super().preprocess(modality, items)
        features = self.feature_extractor(list(items), sampling_rate=self.sampling_rate, return_tensors="pt")
        return PreparedBatch(modality=modality,
                             layouts=[self._audio_layout(int(rows)) for rows in features["num_audio_tokens"]],
                             inputs={"input_features": features["input_features"],
                                     "chunk_sample_lengths": features["chunk_sample_lengths"]})

    def collate(self, batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """Audio chunks padded with zeros to the longest chunk's frames (the encoder masks every frame past a
        chunk's length, so what pads them does not reach a row)."""
        if len(batches) < 2 or batches[0].modality != "audio":
            return super().collate(batches)
        frames = max(batch.inputs["input_features"].shape[-1] for batch in batches)
        features = torch.cat([torch.nn.functional.pad(batch.inputs["input_features"],
                                                      (0, frames - batch.inputs["input_features"].shape[-1]))
                              for batch in batches])
        lengths = torch.cat([batch.inputs["chunk_sample_lengths"] for batch in batches])
        return PreparedBatch(modality="audio", layouts=[layout for batch in batches for layout in batch.layouts],
                             inputs={"input_features": features, "chunk_sample_lengths": lengths})
