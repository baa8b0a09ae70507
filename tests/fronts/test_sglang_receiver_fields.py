"""What `--wire-format sglang` tells SGLang's receiver about each item, beyond its rows: `grid_dim` from the
layout's `receiver_grid` where a family sets one (Muse Spark's merged grids and audio rows, Dots3-Note's audio
rows), and `video_timestamps` from each video clip's frame over `--video-fps`. Families that set neither send
what they always sent (`grid_thw`, audio mel frames, no timestamps)."""

from __future__ import annotations

import pytest
import torch

from encode_server.delivery.formats import wire_format
from encode_server.delivery.sglang_wire import SglangWire
from encode_server.ops.settings import Settings
from encode_server.records import EncodedPart, PartMeta
from processors.base import ItemLayout
from tests.support.sglang_frames import load


def header(wire: SglangWire, modality: str, layouts: list[ItemLayout]):
    tokens = sum(layout.tokens for layout in layouts)
    part = EncodedPart(embedding=torch.zeros(tokens, 8), layouts=tuple(layouts), batch_size=1)
    return load(wire.success_frames(PartMeta("r", 0, 1, modality), part)[0])


def muse_image(ph: int, pw: int) -> ItemLayout:
    return ItemLayout(tokens=ph * pw, grid_thw=(1, 2 * ph, 2 * pw), receiver_grid=(1, ph, pw))


def muse_video(clips: int, ph: int, pw: int) -> ItemLayout:
    return ItemLayout(tokens=clips * ph * pw, grid_thw=(clips, 2 * ph, 2 * pw), receiver_grid=(clips, ph, pw),
                      clip_frames=tuple(2.0 * k for k in range(clips)))


def test_receiver_grids_replace_grid_thw_and_mel_frames():
    wire = SglangWire(video_fps=2.0)
    image = header(wire, "image", [muse_image(2, 3), muse_image(1, 4)])
    assert image.grid_dim.dtype == torch.int64 and image.grid_dim.tolist() == [[1, 2, 3], [1, 1, 4]]
    assert image.video_timestamps is None
    audio = header(wire, "audio", [ItemLayout(7, (1, 1, 7), receiver_grid=7),
                                   ItemLayout(17, (1, 1, 17), mel_frames=999, receiver_grid=17)])
    assert audio.grid_dim.shape == (2,) and audio.grid_dim.tolist() == [7, 17]


def test_video_clip_frames_become_timestamps_in_seconds_per_video():
    video = header(SglangWire(video_fps=2.0), "video", [muse_video(2, 2, 3), muse_video(3, 1, 1)])
    assert video.grid_dim.tolist() == [[2, 2, 3], [3, 1, 1]]
    assert video.video_timestamps == [[0.0, 1.0], [0.0, 1.0, 2.0]]
    assert all(type(stamp) is float for stamps in video.video_timestamps for stamp in stamps)
    assert video.second_per_grid_ts is None


def test_families_without_receiver_fields_send_what_they_always_sent():
    wire = SglangWire(video_fps=2.0)
    video = header(wire, "video", [ItemLayout(8, (2, 4, 4)), ItemLayout(4, (1, 4, 4))])
    assert video.grid_dim.tolist() == [[2, 4, 4], [1, 4, 4]] and video.video_timestamps is None
    audio = header(wire, "audio", [ItemLayout(5, (1, 1, 5), mel_frames=300)])
    assert audio.grid_dim.tolist() == [300]
    with pytest.raises(ValueError, match="mel-frame lengths"):
        header(wire, "audio", [ItemLayout(5, (1, 1, 5))])


def test_a_batch_half_with_clip_frames_is_refused():
    with pytest.raises(ValueError, match="some of this model's video layouts"):
        header(SglangWire(video_fps=2.0), "video", [muse_video(2, 1, 1), ItemLayout(4, (1, 4, 4))])


def test_the_server_wire_takes_the_video_fps_setting():
    class Adapter:
        class info:  # noqa: N801 (a stand-in for ModelInfo)
            family = "muse_spark"

    wire = wire_format(Settings(wire_format="sglang", video_fps=4.0), Adapter())
    assert isinstance(wire, SglangWire) and wire.video_fps == 4.0
    assert header(wire, "video", [muse_video(2, 1, 1)]).video_timestamps == [[0.0, 0.5]]
