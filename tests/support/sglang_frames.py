"""Reading SGLang's frame 0 without SGLang: a restricted unpickler that maps SGLang's class paths to local
stand-ins and refuses every other global but torch's tensor rebuilders (`load`), and the frame's opcodes with
torch's address-named storage keys hidden (`canonical`), to compare frames byte for byte."""

from __future__ import annotations

import io
import pickle
import pickletools
import re

import torch

_TORCH_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"


_STORAGE_KEY = re.compile(rb"X(....)(\d+)q", re.DOTALL)


def canonical(frame: bytes) -> bytes:
    """The frame's opcodes without FRAME markers, with torch's address-named storage keys replaced."""
    ops = list(pickletools.genops(frame))
    out = bytearray()
    for index, (opcode, arg, position) in enumerate(ops):
        end = ops[index + 1][2] if index + 1 < len(ops) else len(frame)
        raw = frame[position:end]
        if opcode.name == "FRAME":
            continue
        if opcode.name in ("BINBYTES", "SHORT_BINBYTES") and arg.startswith(_TORCH_LEGACY_MAGIC):
            def rename(match: re.Match) -> bytes:
                if int.from_bytes(match[1], "little") != len(match[2]):
                    return match[0]
                return b"X\x03\x00\x00\x00KEYq"
            blob = _STORAGE_KEY.sub(rename, arg)
            raw = b"B" + len(blob).to_bytes(4, "little") + blob
        out += raw
    return bytes(out)


class StandIn:
    """Local stand-in for SGLang's `EmbeddingData` (state set by BUILD)."""


class ModalityStandIn(int):
    """Local stand-in for SGLang's `Modality` enum."""


class StandInUnpickler(pickle.Unpickler):
    """Maps SGLang's class paths to local stand-ins; refuses anything outside a small allowlist."""

    CLASSES = {("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"): StandIn,
               ("sglang.srt.disaggregation.encode_receiver", "EmbeddingData"): StandIn,
               ("sglang.srt.managers.schedule_batch", "Modality"): ModalityStandIn,
               ("sglang.srt.multimodal.modality", "Modality"): ModalityStandIn}
    TORCH = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
             ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.CLASSES:
            return self.CLASSES[(module, name)]
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (module, name) in self.TORCH:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not expected in a frame")


def load(frame: bytes) -> StandIn:
    return StandInUnpickler(io.BytesIO(frame)).load()
