"""The SGLang front as the server runs it: the `mooncake` backend's routes and stager, the registry."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from encode_server.delivery.destinations import Delivery
from encode_server.delivery.handover import Handover
from encode_server.fronts.base import Front
from encode_server.fronts.bodies import small_json
from encode_server.fronts.sglang.mooncake import SglangMooncakeStager
from encode_server.fronts.sglang.registry import SglangRegistry
from encode_server.models import EncoderAdapter
from encode_server.ops.setting_values import advertised_url, registry_urls
from encode_server.ops.settings import Settings
from encode_server.records import EncodeError
from encode_server.service import EncoderService


class SglangFront(Front):
    """With `--encoder-transfer-backend mooncake`, the stager (the server's hand-over: rows staged for the
    receivers to pull) and its routes; with `--register-with`, the registration, withdrawn as soon as the
    service starts draining."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stager: SglangMooncakeStager | None = None
        self.registry: SglangRegistry | None = None
        self._withdrawal: asyncio.Task | None = None

    @staticmethod
    def libraries_needed(settings: Settings) -> list[tuple[str, str]]:
        """The optional libraries this front needs with these settings, and what to call it in the refusal
        (checked before the model loads: `runtime.check_libraries`)."""
        needed = []
        if settings.encoder_transfer_backend == "mooncake":
            needed.append(("mooncake", "--encoder-transfer-backend mooncake"))
        if settings.grpc_port is not None:
            needed.append(("grpc", "--grpc-port (SGLang's gRPC encoder service)"))
        return needed

    def mount(self, app: FastAPI) -> None:
        def stager(request: Request) -> SglangMooncakeStager:
            if self.stager is None:
                raise EncodeError(404, f"{request.url.path} is SGLang's mooncake backend's: start the server with "
                                       f"--encoder-transfer-backend mooncake")
            return self.stager

        @app.post("/scheduler_receive_meta_data")
        async def scheduler_receive_meta_data(request: Request) -> JSONResponse:
            """SGLang's mooncake backend: a receiver rank pulls a part's sizes (waiting until they are known)."""
            return await small_json(request, "a pull (req_id, part_idx) is a small JSON object",
                                    lambda payload: stager(request).sizes(payload))

        @app.post("/send")
        async def send(request: Request) -> JSONResponse:
            """SGLang's mooncake backend: write a part's rows into a receiver rank's buffer, then tell its socket."""
            return await small_json(request, "a send is a small JSON object",
                                    lambda payload: stager(request).send(payload))

    async def handover(self, adapter: EncoderAdapter, delivery: Delivery) -> Handover | None:
        if self.settings.encoder_transfer_backend != "mooncake":
            return None
        self.stager = await asyncio.to_thread(SglangMooncakeStager.from_settings, self.settings, adapter, delivery)
        return self.stager

    async def start(self, service: EncoderService) -> None:
        settings = self.settings
        if self.stager is not None:
            service.metrics.watch_transport(self.stager)
        if settings.register_with:
            self.registry = SglangRegistry(registry_urls(settings.register_with),
                                           advertised_url(settings.host, settings.port, settings.advertise_url))
            service.on_drain(self._withdraw)
            self.registry.start()

    def _withdraw(self) -> None:
        """Draining: tell the registries at once, so they stop dispatching here."""
        if self.registry is not None and self._withdrawal is None:
            self._withdrawal = asyncio.get_running_loop().create_task(self.registry.withdraw())

    async def close(self) -> None:
        if self.registry is not None:
            await (self._withdrawal or self.registry.withdraw())
        if self.stager is not None:
            self.stager.close()

    def transport(self) -> dict[str, object]:
        if self.stager is not None:
            return {"sglang": self.stager.info()}
        return {"sglang": {"backend": self.settings.encoder_transfer_backend,
                           "wire_format": self.settings.wire_format}}
