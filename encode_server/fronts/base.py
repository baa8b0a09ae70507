"""What a protocol front is to the rest of the server: routes to mount, and parts to start and close with
the service."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from encode_server.service import EncoderService


class Front:
    """One protocol front. `mount` adds its routes to the app (before start-up: they find what `start` built
    when they run); `start` builds what it runs beside the running service; `close` undoes it before the
    service stops. The defaults do nothing."""

    def mount(self, app: FastAPI) -> None:
        pass

    def wrap(self, asgi: Any) -> Any:
        """The ASGI app to serve in place of `asgi` (a handler in front of the framework), or `asgi` itself."""
        return asgi

    async def start(self, service: EncoderService) -> None:
        pass

    async def close(self) -> None:
        pass

    def transport(self) -> dict[str, Any]:
        """Its entries of `/server_info`'s `transport`: how rows leave this server for its consumers."""
        return {}
