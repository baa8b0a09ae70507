"""The Omni thinkers' processor (Qwen2.5-Omni, Qwen3-Omni): images and videos on the Qwen grid, audio clips to
log-mel frames (the audio tower's inputs).

A clip (mono, at the sampling rate the model's full processor passes, 16 kHz) becomes Whisper log-mel
frames, computed for each clip on its own with the settings the full processor uses (its `audio_kwargs`
and padding), so a clip's frames never depend on the clips beside it. Only a clip's `L` real frames
are kept; a batch's frames are concatenated along time, `[sum L, mel]`, with each clip's `L`
(`feature_lens`), which is what the thinker's `get_audio_features` hands its audio tower after dropping
the padding. The tower cuts every clip into chunks of `2 * n_window` frames, attends within chunks (or
windows of them) of that clip only, and returns the clip's rows in order.

What differs per model (`OmniAudioRule`, one subclass in each family's module): how many frames a clip
of `n` samples has, how many rows `L` frames become (the model's `_get_feat_extract_output_lengths`),
the feature extractor's padding, whether clips longer than its window are cut (then refused here), and
which clips must go through the tower on their own because their rows depend on the padding of the
batch's chunks (`tower_groups`).

`grid_thw` of an audio item is `[1, 1, rows]`; its `mel_frames` (`L`) is what SGLang's receiver and
`get_mm_data` take as the item's `audio_feature_lens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from processors.base import ItemError, ItemLayout, PreparedBatch
from processors.grid import GridProcessor, qwen_image_size_of


class OmniAudioRule:
    """How one Omni model counts an audio clip's frames and rows, and extracts its features."""

    #: The feature extractor's `padding` in the model's full processor.
    padding: str = "max_length"
    #: Whether the full processor cuts clips longer than the extractor's window (`n_samples`).
    truncates: bool = True

    def frames(self, samples: int, feature_extractor: Any) -> int:
        """Mel frames of a clip of `samples` samples, as the extractor's attention mask counts them."""
        raise NotImplementedError

    def rows(self, frames: int) -> int:
        """Rows the audio tower gives for a clip of `frames` mel frames."""
        raise NotImplementedError

    def min_samples(self, feature_extractor: Any) -> int:
        """The shortest clip the extractor takes (an unpadded clip must be longer than half an FFT window, which
        its reflection padding needs)."""
        return 1 if self.padding == "max_length" else int(feature_extractor.n_fft) // 2 + 1

    def tower_groups(self, frames: Sequence[int]) -> list[list[int]]:
        """The clips (indices) that go through the tower together, one forward per group: all of them unless
        some clip's rows would change with the padding its neighbours bring."""
        return [list(range(len(frames)))]


class OmniAudio:
    """Layouts and log-mel features of an Omni thinker's audio clips."""

    def __init__(self, rule: OmniAudioRule, feature_extractor: Any, sampling_rate: int,
                 extractor_kwargs: dict[str, Any] | None = None) -> None:
        if int(feature_extractor.sampling_rate) != int(sampling_rate):
            raise ValueError(f"the feature extractor's sampling rate ({feature_extractor.sampling_rate} Hz) is not the "
                             f"{sampling_rate} Hz the model's processor passes it: the processor refuses every clip")
        self.rule = rule
        self.feature_extractor = feature_extractor
        self.sampling_rate = int(sampling_rate)
        self.hop_length = int(feature_extractor.hop_length)
        self.window_samples = int(feature_extractor.n_samples)
        self.extractor_kwargs = dict(extractor_kwargs or {})

    @property
    def max_samples(self) -> int | None:
        return self.window_samples if self.rule.truncates else None

    def sample_item(self) -> np.ndarray:
        return np.zeros(self.sampling_rate // 10, dtype=np.float32)

    def item_layout(self, item: Any) -> ItemLayout:
        if not isinstance(item, np.ndarray) or item.ndim != 1:
            raise ItemError("expected a mono waveform")
        if self.max_samples is not None and item.shape[0] > self.max_samples:
            raise ItemError(f"audio of {item.shape[0] / self.sampling_rate:.2f} s is longer than the model's window "
                            f"of {self.max_samples / self.sampling_rate:g} s (its processor would cut it)")
        frames = self.rule.frames(item.shape[0], self.feature_extractor)
        rows = self.rule.rows(frames) if frames > 0 else 0
        if rows < 1 or item.shape[0] < self.rule.min_samples(self.feature_extractor):
            raise ItemError(f"audio of {item.shape[0]} samples is too short to yield an embedding")
        return ItemLayout(tokens=rows, grid_thw=(1, 1, rows), mel_frames=frames)

    def _features(self, clip: np.ndarray) -> torch.Tensor:
        """The clip's real frames `[L, mel]`, as the full processor computes them for it."""
        features = self.feature_extractor(
            clip, sampling_rate=self.sampling_rate, return_attention_mask=True, return_tensors="pt",
            **{**self.extractor_kwargs, "padding": self.rule.padding, "truncation": self.rule.truncates})
        frames = int(features["attention_mask"][0].sum())
        return features["input_features"][0, :, :frames].T

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        layouts = [self.item_layout(item) for item in items]  # a bad clip fails here, alone, with its reason
        features = [self._features(item) for item in items]
        for layout, frames in zip(layouts, features):
            if frames.shape[0] != layout.mel_frames:
                raise RuntimeError(f"the feature extractor gave {frames.shape[0]} frames for a clip whose layout "
                                   f"counts {layout.mel_frames}")
        lens = torch.tensor([layout.mel_frames for layout in layouts], dtype=torch.long)
        return PreparedBatch(modality=modality, layouts=layouts,
                             inputs={"input_features": torch.cat(features), "feature_lens": lens})


MODALITIES = ("image", "video", "audio")


class OmniThinkerProcessor(GridProcessor):
    """Images and videos as `GridProcessor` makes them (the Qwen2-VL image processor's sizing), audio through
    `OmniAudio`."""

    def __init__(self, image_processor: Any, video: Any, audio: OmniAudio) -> None:
        super().__init__(image_processor, video, qwen_image_size_of(image_processor), modalities=MODALITIES)
        self.audio = audio
        self.sampling_rate = audio.sampling_rate  # the decoder resamples clips to it

    def item_layout(self, modality: str, item: Any) -> ItemLayout:
        if modality == "audio":
            return self.audio.item_layout(item)
        return super().item_layout(modality, item)

    def preprocess(self, modality: str, items: Sequence[Any]) -> PreparedBatch:
        if modality == "audio":
            return self.audio.preprocess(modality, items)
        return super().preprocess(modality, items)
