"""What every EC connector's producer side is to the vLLM front (as vLLM's `ec_connector/base.py` is to its
engine): one `Connector` interface, and the `ItemRows` record the producer hands each one.

A connector is built by `factory.create_connector` from the transfer config, once, at start-up. For each
request the producer gives it every media item, in order, identified and with its rows (`ItemRows`); the
connector hands them over its way (files, a push into the consumer's buffer, a pool the consumer reads) and
returns the answer's `ec_transfer_params`, one entry per identifier as vLLM's producer writes it
(`collect_ec_item_metadata`), with its own handles merged in. `held` lets a connector that keeps items where
consumers find them by identifier (the shared files) say so before anything is encoded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from encode_server.fronts.vllm.versions import VllmVersion
from processors.base import ItemLayout

#: (family, modality) -> the placeholder fields vLLM's data parser declares (`embedding_fields`, role
#: "metadata"), where this server can fill every one of them. Elsewhere nothing is published and the proxy sends
#: the consumer the media itself (Qwen3-VL videos also need their timestamps, the Omni models' videos
#: `second_per_grid_ts` and their audio `audio_feature_lengths`; GLM-4.1V declares none). Checked against
#: vLLM's own declarations by `tools/compat/vllm_transport_compat.py`.
PLACEHOLDER_FIELDS: dict[tuple[str, str], str] = {
    **{(family, "image"): "image_grid_thw" for family in
       ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni_moe")},
    ("qwen2_vl", "video"): "video_grid_thw",
    ("qwen2_5_vl", "video"): "video_grid_thw",
    ("qwen2_audio", "audio"): "audio_num_tokens",
}

#: Where an item's rows came from: encoded here, held by the connector already, or the shared tier.
SOURCES = ("encoded", "held", "store")


@dataclass(frozen=True)
class ItemRows:
    """One media item of a request as the producer hands it over: its identifier (vLLM's `mm_hash`), modality,
    rows (None: `held` by the connector already, `tokens` of them), layout (None: not decoded here, an item
    named by its uuid alone) and where the rows came from (`SOURCES`)."""

    identifier: str
    modality: str
    rows: torch.Tensor | None
    layout: ItemLayout | None = None
    source: str = "encoded"
    tokens: int | None = None

    @property
    def rows_count(self) -> int | None:
        return int(self.rows.shape[0]) if self.rows is not None else self.tokens

    @property
    def hit(self) -> bool:
        return self.source != "encoded"


def placeholder_metadata(family: str, item: ItemRows) -> dict[str, list[int]]:
    """What vLLM's producer publishes beside an item for its consumer to size the placeholder with
    (`MultiModalDataParser.placeholder_metadata_fields`); empty where this server does not know it."""
    name = PLACEHOLDER_FIELDS.get((family, item.modality))
    if name is None or item.layout is None:
        return {}
    if name == "audio_num_tokens":
        return {name: [int(item.layout.tokens)]}
    return {name: [int(value) for value in item.layout.grid_thw]}


def transfer_params(items: list[ItemRows], family: str, version: VllmVersion,
                    handle=None) -> dict[str, dict[str, Any]]:
    """`ec_transfer_params` as vLLM's `collect_ec_item_metadata` builds them: keyed by identifier, each with its
    `modality` (0.33 only), `item_indices` (every position it has in the request) and `metadata`; `handle(item)`
    adds the connector's own keys (a transfer id, a peer's address)."""
    answer: dict[str, dict[str, Any]] = {}
    for index, item in enumerate(items):
        entry = answer.get(item.identifier)
        if entry is None:
            entry = answer[item.identifier] = ({"modality": item.modality} if version.names_item_modality else {})
            entry["item_indices"] = []
        entry["metadata"] = placeholder_metadata(family, item)
        entry["item_indices"].append(index)
        if handle is not None:
            entry.update(handle(item))
    return answer


class Connector(ABC):
    """The producer side of one of vLLM's EC connectors; see the module docstring."""

    #: vLLM's name of the connector (`ec_connector` in the transfer config).
    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_config(cls, config: Any, service: Any, settings: Any, version: VllmVersion) -> Connector:
        """Built for the served model from the transfer config (`transfer_config.ECTransferConfig`), the running
        `EncoderService` and the server's settings; blocking (sockets, registered memory): run in a thread."""

    def held(self, identifier: str) -> int | None:
        """The rows of an item this connector already keeps where consumers find it (None: not kept, or not a
        connector that keeps items). Called in a media thread."""
        return None

    @abstractmethod
    async def hand_over(self, items: list[ItemRows], params: Any, request_id: str) -> dict[str, Any]:
        """Hand every item over to the consumers; the answer's `ec_transfer_params`. `params` is the request's
        own `ec_transfer_params` (None when it sent none). `EncodeError` on failure."""

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What `/server_info` shows of it."""

    def watch(self, metrics: Any) -> None:
        """Export its figures (`ops.metrics.ServerMetrics`)."""
        metrics.watch_transport(self)

    def close(self) -> None:  # noqa: B027 - a connector holding nothing has nothing to release
        """Release what it holds (sockets, registered memory, threads)."""
