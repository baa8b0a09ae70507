"""A video item as the server samples it, and the per-patch timestamps some models put in their prompt.

`VideoClip` is a list of PIL frames (every family takes it as one) that also says where its frames
come from, as `transformers` records it in a video's `VideoMetadata` once frames are sampled: the
source's frame rate (`fps`) and each frame's index in the source (`frames_indices`). The server's
decoder makes one for every video item (`encode_server.media.decoding`).

Some models write the time of each temporal patch into the prompt, and SGLang's prefill side builds
the same prompt from the `video_timestamps` an encoder sends; each frame is at `index / fps` seconds:
- Qwen3-VL and Qwen3.5 (`<t seconds>` before the patch's tokens, `Qwen3VLProcessor`): the clip padded
  with its last frame to whole temporal patches, each patch at the mean of its first and last frame
  (`patch_timestamps`, as `Qwen3VLProcessor._calculate_timestamps`);
- MiniMax-M3 VL (`]<]t seconds[>[`, `MiniMaxM3VLProcessor.replace_video_token`): each patch at its
  first frame (`first_frame_timestamps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


class VideoClip(list):
    """A video's sampled frames, in order, with the source's `fps` and each frame's index in the source."""

    def __init__(self, frames: Iterable[Any], fps: float, frames_indices: Iterable[int]) -> None:
        super().__init__(frames)
        indices = tuple(int(index) for index in frames_indices)
        if len(indices) != len(self):
            raise ValueError(f"{len(self)} frames but {len(indices)} frame indices")
        if not fps > 0:
            raise ValueError(f"a video's fps must be positive, got {fps!r}")
        self.fps = float(fps)
        self.frames_indices = indices

    def __repr__(self) -> str:
        return f"VideoClip({len(self)} frames, fps={self.fps:g}, frames_indices={list(self.frames_indices)})"


def patch_timestamps(frames_indices: Sequence[int], fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Seconds of each temporal patch of a clip, as `transformers`' `Qwen3VLProcessor` computes them."""
    indices = list(frames_indices)
    if not indices:
        return ()
    size = int(temporal_patch_size)
    if len(indices) % size:
        indices.extend(indices[-1] for _ in range(size - len(indices) % size))
    times = [index / fps for index in indices]
    return tuple((times[start] + times[start + size - 1]) / 2 for start in range(0, len(times), size))


def first_frame_timestamps(frames_indices: Sequence[int], fps: float, temporal_patch_size: int
                           ) -> tuple[float, ...]:
    """Seconds of each temporal patch at its first frame, as `transformers`' `MiniMaxM3VLProcessor` writes them."""
    indices = list(frames_indices)
    size = int(temporal_patch_size)
    patches = -(-len(indices) // size)
    return tuple(indices[min(patch * size, len(indices) - 1)] / fps for patch in range(patches))


#: (frames_indices, fps, temporal_patch_size) -> each temporal patch's seconds.
TimestampRule = Callable[[Sequence[int], float, int], tuple[float, ...]]


def clip_timestamps(item: Any, temporal_patch_size: int, rule: TimestampRule = patch_timestamps
                    ) -> tuple[float, ...] | None:
    """`rule`'s timestamps of a `VideoClip`; None for frames that do not say where they come from."""
    if not isinstance(item, VideoClip):
        return None
    return rule(item.frames_indices, item.fps, temporal_patch_size)
