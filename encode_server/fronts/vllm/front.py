"""The vLLM front as the server runs it: the chat route, answered by the producer and the one connector the
settings name (`--ec-storage`, or `--ec-transfer-config`), which `start` builds beside the service."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from encode_server.fronts.base import Front
from encode_server.fronts.vllm.completions import ChatCompletions
from encode_server.fronts.vllm.routes import add_chat_route
from encode_server.fronts.vllm.transfer_config import connector_config
from encode_server.fronts.vllm.versions import parse_vllm_version
from encode_server.service import EncoderService


class VllmFront(Front):
    """Off (the chat route answers 404) unless `--ec-storage` or `--ec-transfer-config` is given. Its settings
    are read here, so a value it cannot honour is refused before anything starts (`ValueError`)."""

    def __init__(self, settings: Any) -> None:
        self.max_request_bytes = settings.max_request_bytes
        config = connector_config(settings)
        version = parse_vllm_version(settings.ec_vllm_version)
        self.completions = ChatCompletions(settings, config, version) if config is not None else None

    def mount(self, app: FastAPI) -> None:
        add_chat_route(app, self.completions, self.max_request_bytes)

    async def start(self, service: EncoderService) -> None:
        if self.completions is not None:
            await self.completions.start(service)

    async def close(self) -> None:
        if self.completions is not None:
            await self.completions.close()

    def transport(self) -> dict[str, Any]:
        return {"vllm": self.completions.info() if self.completions is not None else None}
