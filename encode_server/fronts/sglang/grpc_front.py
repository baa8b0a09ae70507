"""The gRPC front as the server runs it (`--grpc-port`): grpcio's asyncio server on the HTTP event loop,
serving SGLang's `SglangEncoder` (`grpc_service.py`), `grpc.health.v1.Health` and server reflection, the
three services SGLang's own gRPC encoder lists.

It lives in the SGLang front because it is SGLang's protocol: the same requests as SGLang's HTTP encoder,
its `mooncake` stager for `Send`, its wire format for the rows. Imported only when `--grpc-port` is set (grpcio
and smg-grpc-proto are the optional `grpc` extra).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import sglang_encoder_pb2_grpc

from encode_server.fronts.base import Front
from encode_server.fronts.sglang.grpc_service import ENCODER_SERVICE, EncoderHealth, SglangEncoderService
from encode_server.ops.settings import Settings
from encode_server.ops.tracing import Tracing
from encode_server.service import EncoderService

log = logging.getLogger("encode_server.fronts.sglang.grpc_front")

#: The services reflection lists, as SGLang's gRPC encoder lists them.
SERVICE_NAMES = (ENCODER_SERVICE, "grpc.health.v1.Health", reflection.SERVICE_NAME)
#: Seconds calls in flight get to finish when the server stops (after the drain, few are left).
STOP_GRACE_S = 5.0


class GrpcStartError(RuntimeError):
    """The gRPC port cannot be listened on; the message names the fix."""


def listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host or '0.0.0.0'}:{port}"


class SglangGrpcFront(Front):
    """`--grpc-port`: started after the service, stopped before it."""

    def __init__(self, settings: Settings, tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing  # None: traces off
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self, service: EncoderService) -> None:
        settings = self.settings
        server = grpc.aio.server(options=[
            # A second server on the port fails here instead of sharing it.
            ("grpc.so_reuseport", 0),
            # What HTTP takes (--max-request-bytes); a larger call is RESOURCE_EXHAUSTED from gRPC itself.
            ("grpc.max_receive_message_length", settings.max_request_bytes),
            ("grpc.max_send_message_length", 64 << 20),
        ])
        sglang_encoder_pb2_grpc.add_SglangEncoderServicer_to_server(
            SglangEncoderService(service, settings.api_key, settings.api_key_exempt_cidrs, self.tracing), server)
        health_pb2_grpc.add_HealthServicer_to_server(EncoderHealth(service), server)
        reflection.enable_server_reflection(SERVICE_NAMES, server)
        address = listen_address(settings.host, settings.grpc_port)
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise GrpcStartError(f"cannot listen for gRPC on {address} ({exc}): stop what listens there or choose "
                                 f"another port with --grpc-port (or ENCODER_GRPC_PORT)") from None
        await server.start()
        self.server = server
        log.info("gRPC: %s, health and reflection on %s", ENCODER_SERVICE,
                 listen_address(settings.host, self.port))

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(STOP_GRACE_S)
            self.server = None

    def transport(self) -> dict[str, Any]:
        return {"grpc": {"address": listen_address(self.settings.host, self.port or self.settings.grpc_port),
                         "port": self.port, "services": list(SERVICE_NAMES),
                         "wire_format": self.settings.wire_format}}
