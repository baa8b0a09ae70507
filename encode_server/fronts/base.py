"""What a protocol front is to the rest of the server: routes to mount, the hand-over its receivers need
(if not ZMQ delivery), and parts to start and close with the service."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp

from encode_server.delivery.destinations import Delivery
from encode_server.delivery.handover import Handover
from encode_server.models import EncoderAdapter
from encode_server.service import EncoderService


class Front:
    """One protocol front. `mount` adds its routes to the app (before start-up: they find what `handover` and
    `start` built when they run); `handover` is asked once, while the runtime is built and before the service
    exists, for the hand-over its receivers need in place of ZMQ delivery; `start` builds what it runs beside
    the running service; `close` undoes both before the service stops. The defaults do nothing."""

    def mount(self, app: FastAPI) -> None:
        pass

    def wrap(self, asgi: ASGIApp) -> ASGIApp:
        """The ASGI app to serve in place of `asgi` (a handler in front of the framework), or `asgi` itself."""
        return asgi

    async def handover(self, adapter: EncoderAdapter, delivery: Delivery) -> Handover | None:
        """The hand-over every request's rows go through instead of `delivery` (ZMQ), or None (the default:
        this front's consumers take ZMQ delivery or none). At most one front may give one; `delivery` is
        there for the parts it does not take itself."""
        return None

    async def start(self, service: EncoderService) -> None:
        pass

    async def close(self) -> None:
        pass

    def transport(self) -> dict[str, object]:
        """Its entries of `/server_info`'s `transport`: how rows leave this server for its consumers."""
        return {}
