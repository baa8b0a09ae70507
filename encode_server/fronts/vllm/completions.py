"""What answers the vLLM front's `/v1/chat/completions`: the producer and the connector, built when the service
starts, for the one connector the settings name (`transfer_config.connector_config`).

An encoder request of vLLM's EPD proxy is a chat body with media parts: one item per request (`max_tokens` 1,
the shape of vLLM's first proxies), or an encoder's items grouped into one request, each with a `uuid` (the
current example proxy) or without. Either way every item is identified, encoded (or found) and handed over,
and the answer's `ec_transfer_params` name each identifier with its positions in the request (`item_indices`),
which is how the proxy matches them back.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from encode_server.fronts.vllm.chat import media_parts
from encode_server.fronts.vllm.connectors.base import Connector, ItemRows
from encode_server.fronts.vllm.connectors.factory import create_connector
from encode_server.fronts.vllm.producer import VllmProducer
from encode_server.fronts.vllm.transfer_config import ECTransferConfig
from encode_server.fronts.vllm.versions import VllmVersion
from encode_server.records import EncodeError
from encode_server.service import EncoderService


@dataclass(frozen=True)
class Completion:
    """One encoder request answered: the model it names, its items in order, the answer's `ec_transfer_params`."""

    model: str
    items: list[ItemRows]
    transfer_params: dict[str, Any]


class ChatCompletions:
    """The vLLM producer behind the chat route; `start` builds its parts beside the running service."""

    def __init__(self, settings: Any, config: ECTransferConfig, version: VllmVersion) -> None:
        self.settings = settings
        self.config = config
        self.version = version
        self._producer: VllmProducer | None = None
        self._connector: Connector | None = None

    async def start(self, service: EncoderService) -> None:
        self._connector = await asyncio.to_thread(create_connector, self.config, service, self.settings, self.version)
        self._connector.watch(service.metrics)
        self._producer = await asyncio.to_thread(VllmProducer.from_settings, service, self.settings, self._connector,
                                                 self.version)

    async def answer(self, payload: Any, request_id: str) -> Completion:
        """Encode (or find) and hand over every media item of one encoder request. `EncodeError` on failure."""
        producer, connector = self._producer, self._connector
        if producer is None or connector is None:
            raise EncodeError(503, "the vLLM producer is starting", request_id, headers={"Retry-After": "1"})
        parts = media_parts(payload)
        model = payload.get("model") if isinstance(payload.get("model"), str) else self.settings.model
        # A proxy may send several requests under one x-request-id (one per item): admission needs its own id.
        job_id = f"{request_id[:400]}#{uuid.uuid4().hex[:12]}"
        items = await producer.rows(parts, job_id)
        params = await connector.hand_over(items, payload.get("ec_transfer_params"), request_id)
        return Completion(model, items, params)

    def info(self) -> dict[str, Any]:
        """`/server_info`'s `transport.vllm`."""
        if self._connector is None:
            return {"connector": self.config.connector, "role": self.config.role}
        return {**self._connector.info(), "vllm_version": self.version.text}

    async def close(self) -> None:
        if self._producer is not None:
            self._producer.close()
        if self._connector is not None:
            await asyncio.to_thread(self._connector.close)
