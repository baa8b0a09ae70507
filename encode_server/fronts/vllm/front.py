"""The vLLM front as the server runs it: the producer (`--ec-storage` or `--ec-transfer-config`), the
connector that hands rows over (`ECMooncakeConnector` pushes them, `ECCPUConnector` keeps them for the
consumers' NIXL reads), and the chat route."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from encode_server.fronts.base import Front
from encode_server.fronts.vllm.mooncake_connector import MooncakePusher
from encode_server.fronts.vllm.producer import VllmProducer
from encode_server.fronts.vllm.routes import add_chat_route
from encode_server.ops.settings import Settings
from encode_server.service import EncoderService


class VllmFront(Front):
    """Off (the chat route answers 404) unless `--ec-storage` or `--ec-transfer-config` is given."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer: VllmProducer | None = None
        self.pusher: Any = None  # MooncakePusher or CPUConnectorProducer: `push`, `info`, `close`

    def mount(self, app: FastAPI) -> None:
        add_chat_route(app, self)

    async def start(self, service: EncoderService) -> None:
        settings = self.settings
        if settings.ec_storage_folder or settings.vllm_push:
            self.producer = await asyncio.to_thread(VllmProducer.from_settings, service, settings)
        if settings.vllm_push and settings.vllm_push.connector == "ECCPUConnector":
            from encode_server.fronts.vllm.cpu_connector import CPUConnectorProducer  # NIXL: an optional extra

            self.pusher = await asyncio.to_thread(CPUConnectorProducer.from_settings, settings, service.adapter)
            service.metrics.watch_transport(self.pusher)
        elif settings.vllm_push:
            self.pusher = await asyncio.to_thread(MooncakePusher, settings.vllm_push, service.adapter.info.family)
            service.metrics.watch_transport(self.pusher)

    async def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        if self.pusher is not None:
            self.pusher.close()

    def transport(self) -> dict[str, Any]:
        if self.pusher is not None:
            return {"vllm": self.pusher.info()}
        if self.settings.ec_storage_folder:
            return {"vllm": {"connector": "ECExampleConnector", "role": "ec_producer",
                             "shared_storage_path": self.settings.ec_storage_folder}}
        return {"vllm": None}
