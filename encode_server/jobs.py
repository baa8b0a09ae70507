"""The typed records that flow one way through the service.

`EncodeJob` is an admitted request with its items already decoded; `EncodeOutcome` is what the
engine hands back for it; `EncodeError` is any failure, carrying the HTTP status it maps to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class EncodeError(Exception):
    """A request that ends in an error response: status code, message, and optional headers."""

    def __init__(self, status: int, message: str, req_id: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.req_id = req_id
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"status": "error", "message": self.message, "req_id": self.req_id}


@dataclass
class EncodeJob:
    """One request part, validated, with decoded items and their expected layouts."""

    req_id: str
    part_idx: int
    num_parts: int
    modality: str
    items: list[Any]  # decoded media (PIL images, frame lists, waveforms)
    layouts: list[Any]  # processors.ItemLayout per item
    preprocess_s: float = 0.0  # time spent fetching and decoding the items
    raw_items: list[Any] = field(default_factory=list)  # each item's file bytes (or frames' bytes)

    @property
    def tokens(self) -> int:
        return sum(layout.tokens for layout in self.layouts)


@dataclass
class EncodeOutcome:
    """A finished job: its embedding rows `[tokens, dim]` on the CPU and how the time was spent."""

    embedding: torch.Tensor
    layouts: list[Any]
    batch_size: int
    timings_ms: dict[str, float] = field(default_factory=dict)
