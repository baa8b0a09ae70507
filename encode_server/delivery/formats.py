"""Which `WireFormat` the server writes: `--wire-format` (native or sglang) for the model it serves."""

from __future__ import annotations

from encode_server.delivery.destinations import WireFormat
from encode_server.delivery.native_wire import NativeWire
from encode_server.delivery.sglang_wire import SglangWire, seconds_per_grid_step
from encode_server.models import EncoderAdapter
from encode_server.ops.settings import Settings


def wire_format(settings: Settings, adapter: EncoderAdapter) -> WireFormat:
    """The ZMQ frames `--wire-format` asks for."""
    if settings.wire_format == "sglang":
        return SglangWire(settings.sglang_embedding_class, seconds_per_grid_step(adapter, settings.video_fps),
                          video_fps=settings.video_fps)
    return NativeWire(adapter)
