"""How the Omni thinkers' full processors count an audio clip's mel frames and rows (`OmniAudioRule`s of
`omni_audio.py`): Qwen2.5-Omni pads every clip to the extractor's window and cuts longer ones; Qwen3-Omni pads
none alone and cuts none, and its tower chunks each clip into `2 * n_window` frames."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from processors.families.qwen2_audio import audio_output_rows
from processors.omni_audio import OmniAudioRule


class Qwen25OmniAudioRule(OmniAudioRule):
    """`Qwen2_5OmniProcessor`'s audio: padded to the window, `ceil(samples / hop)` frames (at most the window's)."""

    padding = "max_length"
    truncates = True

    def frames(self, samples: int, feature_extractor: Any) -> int:
        return min(-(-samples // int(feature_extractor.hop_length)), int(feature_extractor.nb_max_frames))

    def rows(self, frames: int) -> int:
        return audio_output_rows(frames)


#: Frames per audio chunk (`2 * n_window`) and rows per full chunk that the processor's and SGLang's counts assume.
CHUNK_FRAMES = 100
ROWS_PER_CHUNK = 13


def audio_rows(frames: int) -> int:
    """`_get_feat_extract_output_lengths` of `processing_qwen3_omni_moe` (n_window 50)."""
    leave = frames % CHUNK_FRAMES
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // CHUNK_FRAMES) * ROWS_PER_CHUNK


class Qwen3OmniAudioRule(OmniAudioRule):
    """`Qwen3OmniMoeProcessor`'s audio: no padding alone, no truncation, `samples // hop` frames."""

    padding = "longest"
    truncates = False

    def frames(self, samples: int, feature_extractor: Any) -> int:
        return samples // int(feature_extractor.hop_length)

    def rows(self, frames: int) -> int:
        return audio_rows(frames)

    def tower_groups(self, frames: Sequence[int]) -> list[list[int]]:
        """Clips of a chunk or more together; shorter ones with the clips of their own length only."""
        groups: dict[int, list[int]] = {}
        for index, count in enumerate(frames):
            groups.setdefault(min(count, CHUNK_FRAMES), []).append(index)
        return list(groups.values())
