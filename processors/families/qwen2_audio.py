"""Qwen2-Audio's processor: a mono clip at the feature extractor's rate becomes a log-mel spectrogram padded to the
extractor's window (30 s in published checkpoints); its real length is `L = ceil(samples / hop)` frames, and the
tower's convolution and pooler halve it twice: `((L - 1) // 2 + 1 - 2) // 2 + 1` rows
(`_get_feat_extract_output_lengths`). A clip longer than the window is refused, not cut."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from processors.base import ItemError, ItemLayout, PreparedBatch, Processor


def audio_output_rows(frames: int) -> int:
    """Rows the audio tower yields for `frames` mel frames (conv stride 2, then avg-pool 2)."""
    after_conv = (frames - 1) // 2 + 1
    return max(0, (after_conv - 2) // 2 + 1)


class QwenAudioProcessor(Processor):
    """Waveforms to `input_features` padded to the window, with each clip's real frame count."""

    modalities = ("audio",)

    def __init__(self, feature_extractor: Any) -> None:
        self.feature_extractor = feature_extractor
        self.sampling_rate = int(feature_extractor.sampling_rate)
        self.hop_length = int(feature_extractor.hop_length)
        self.window_samples = int(feature_extractor.n_samples)
        self.max_seconds = self.window_samples / self.sampling_rate

    def sample_item(self) -> tuple[str, Any]:
        return "audio", np.zeros(self.sampling_rate // 10, dtype=np.float32)

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if not isinstance(item, np.ndarray) or item.ndim != 1:
            raise ItemError("expected a mono waveform")
        if item.shape[0] > self.window_samples:
            raise ItemError(f"audio of {item.shape[0] / self.sampling_rate:.2f} s is longer than the model's "
                            f"window of {self.max_seconds:g} s: send it as several clips of at most that "
                            "(one item each)")
        frames = -(-item.shape[0] // self.hop_length)
        rows = audio_output_rows(frames)
        if rows < 1:
            raise ItemError(f"audio of {item.shape[0]} samples is too short to yield an embedding")
        return ItemLayout(tokens=rows, grid_thw=(1, 1, rows), mel_frames=frames)

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        features = self.feature_extractor(
            list(items), sampling_rate=self.sampling_rate, return_attention_mask=True, padding="max_length",
            return_tensors="pt")
        frames = features["attention_mask"].sum(-1)
        rows = [audio_output_rows(int(n)) for n in frames]
        return PreparedBatch(modality=modality, layouts=[ItemLayout(tokens=r, grid_thw=(1, 1, r), mel_frames=int(n))
                                                         for r, n in zip(rows, frames)],
                             inputs={"input_features": features["input_features"], "frames": frames})
