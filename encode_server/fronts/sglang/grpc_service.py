"""SGLang's gRPC encoder service, `sglang.grpc.encoder.SglangEncoder` (SGLang 0.5.23's
`disaggregation/encoder/grpc_server.py`; the messages are the registry's `smg-grpc-proto`), and gRPC health.

Each RPC is the HTTP exchange of the same name, through the same pipeline (`EncoderService`):

- `Encode` is `/encode`: the request's fields as its body (`embedding_port` empty: the ranks register, SGLang's
  `zmq_to_scheduler`; one port: `zmq_to_tokenizer`; several: each is sent to), the modality of its items
  (`item_modality`: SGLang's request names none), the call's deadline as its `timeout_s` (a little before, so
  the receivers hear of a timeout), `priority` from the call's metadata. It answers `embedding_size` (bytes),
  `embedding_len` (rows) and `embedding_dim` (row width) in every transfer mode (SGLang fills them only with
  `mooncake`, where the rows then stay staged for `Send`).
- `SchedulerReceiveUrl` is `/scheduler_receive_url`; `Send` is the `mooncake` backend's `/send` (one receiver:
  the message has no `receive_count`).
- An error is the gRPC status of its HTTP status (`GRPC_STATUS`) with the same message, and trailing metadata
  `http-status` (and `retry-after` where HTTP sends Retry-After).

With `--api-key`, the three RPCs need `authorization: Bearer <key>` metadata unless the peer is in
`--api-key-exempt-cidrs`, as HTTP does; health and reflection stay open, as `/health` does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import sglang_encoder_pb2, sglang_encoder_pb2_grpc

from encode_server.fronts.sglang.item_modality import part_modality
from encode_server.fronts.sglang.mooncake import SglangMooncakeStager
from encode_server.models.dtypes import DTYPE_NAMES
from encode_server.ops.setting_values import exempt_networks, in_networks
from encode_server.ops.tracing import Tracing, call_traced
from encode_server.records import EncodeError
from encode_server.service import EncoderService

log = logging.getLogger("encode_server.fronts.sglang.grpc_service")

#: The full name of the encoder service, as health checks and reflection name it.
ENCODER_SERVICE = sglang_encoder_pb2.DESCRIPTOR.services_by_name["SglangEncoder"].full_name
#: HTTP status -> gRPC status; any other 4xx is FAILED_PRECONDITION, any other 5xx INTERNAL.
GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED, 502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
#: How much of the call's deadline the request's own timeout leaves, at most: the 504 (and the receivers'
#: failure frames) then come before gRPC cancels the call.
DEADLINE_MARGIN_S = 0.05


def grpc_status(http_status: int) -> grpc.StatusCode:
    if http_status in GRPC_STATUS:
        return GRPC_STATUS[http_status]
    return grpc.StatusCode.FAILED_PRECONDITION if http_status < 500 else grpc.StatusCode.INTERNAL


async def abort(context: grpc.aio.ServicerContext, error: EncodeError) -> None:
    """End the call with the error's gRPC status and message (raises)."""
    trailing = [("http-status", str(error.status))]
    if "Retry-After" in error.headers:
        trailing.append(("retry-after", error.headers["Retry-After"]))
    await context.abort(grpc_status(error.status), error.message, tuple(trailing))


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}


def _peer_address(peer: str) -> str:
    """`ipv4:127.0.0.1:5000` / `ipv6:[::1]:5000` -> the address."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[")
    return rest.rpartition(":")[0] if kind == "ipv4" else ""


class SglangEncoderService(sglang_encoder_pb2_grpc.SglangEncoderServicer):
    """The three RPCs over the running `EncoderService`; see the module docstring."""

    def __init__(self, service: EncoderService, api_key: str | None = None, exempt_cidrs: str | None = None,
                 tracing: Tracing | None = None) -> None:
        self.service = service
        self.tracing = tracing  # Encode calls continue their metadata's traceparent (None: traces off)
        self._key = api_key.encode() if api_key else None
        self._exempt = exempt_networks(exempt_cidrs)

    def _refusal(self, context: grpc.aio.ServicerContext) -> EncodeError | None:
        if self._key is None or (self._exempt and in_networks(_peer_address(context.peer()), self._exempt)):
            return None
        given = _metadata(context).get("authorization", "")
        scheme, _, token = given.partition(" ")
        if hmac.compare_digest(token.encode(), self._key) and scheme.lower() == "bearer":
            return None
        return EncodeError(401, f"{'bad' if given else 'missing'} API key: send the metadata authorization: "
                                f"Bearer <key>")

    async def _answer(self, context: grpc.aio.ServicerContext, req_id: str,
                      work: Callable[[], Awaitable[Any]]) -> Any:
        """`work()`'s answer, or the call ended with the gRPC status of its `EncodeError`."""
        error = self._refusal(context)
        if error is None:
            try:
                return await work()
            except EncodeError as failed:
                error = failed
            except ValueError as exc:
                error = EncodeError(400, str(exc))
            except asyncio.CancelledError:
                if not self.service.admission.draining:
                    raise  # the client went away (or its deadline passed): gRPC has already answered it
                error = EncodeError(503, "the server is shutting down", headers={"Retry-After": "1"})
            except Exception as exc:  # a bug: still one answer, with the message
                log.exception("unexpected error in gRPC %s", req_id)
                error = EncodeError(500, f"internal error: {exc}")
        error.req_id = error.req_id or req_id
        await abort(context, error)

    async def Encode(self, request, context):  # noqa: N802 - the generated servicer's name
        async def work() -> Any:
            metadata = _metadata(context)
            items = list(request.mm_items)
            payload: dict[str, Any] = {"req_id": request.req_id, "mm_items": items,
                                       "modality": part_modality(items, metadata.get("modality")),
                                       "num_parts": request.num_parts or 1, "part_idx": request.part_idx}
            if request.prefill_host:
                payload["prefill_host"] = request.prefill_host
            ports = list(request.embedding_port)
            if ports:
                payload["embedding_port"] = ports[0] if len(ports) == 1 else ports
            remaining = context.time_remaining()
            if remaining is not None:
                payload["timeout_s"] = max(remaining - min(DEADLINE_MARGIN_S, remaining / 10), 1e-3)
            if "priority" in metadata:
                try:
                    payload["priority"] = int(metadata["priority"])
                except ValueError:
                    raise EncodeError(400, f"the priority metadata must be an integer, got "
                                           f"{metadata['priority']!r}") from None
            answer = await self.service.encode(payload, front="grpc")
            return sglang_encoder_pb2.EncodeResponse(**sizes_of(answer))

        return await self._answer(context, request.req_id, lambda: call_traced(
            self.tracing, "SglangEncoder/Encode", context.invocation_metadata() or (), work))

    async def SchedulerReceiveUrl(self, request, context):  # noqa: N802
        async def work() -> Any:
            registration: dict[str, Any] = {"req_id": request.req_id, "receive_url": request.receive_url}
            if request.receive_count:  # 0: unset in proto3, the HTTP default (1)
                registration["receive_count"] = request.receive_count
            await self.service.register_receiver(registration)
            return sglang_encoder_pb2.SchedulerReceiveUrlResponse()

        return await self._answer(context, request.req_id, work)

    async def Send(self, request, context):  # noqa: N802
        async def work() -> Any:
            stager = self.service.handover
            if not isinstance(stager, SglangMooncakeStager):
                raise EncodeError(404, "Send is SGLang's mooncake backend's: start the server with "
                                       "--encoder-transfer-backend mooncake")
            await stager.send({"req_id": request.req_id, "prefill_host": request.prefill_host,
                               "embedding_port": request.embedding_port, "session_id": request.session_id,
                               "buffer_address": request.buffer_address})
            return sglang_encoder_pb2.SendResponse()

        return await self._answer(context, request.req_id, work)


def sizes_of(answer: dict[str, Any]) -> dict[str, int]:
    """`EncodeResponse`'s fields from an `/encode` answer: the mooncake backend's own, else from its shape."""
    if "embedding_size" in answer:
        return {name: int(answer[name]) for name in ("embedding_size", "embedding_len", "embedding_dim")}
    rows, width = (int(n) for n in answer["embedding_shape"])
    itemsize = next(dtype.itemsize for dtype, name in DTYPE_NAMES.items() if name == answer["dtype"])
    return {"embedding_size": rows * width * itemsize, "embedding_len": rows, "embedding_dim": width}


class EncoderHealth(health_pb2_grpc.HealthServicer):
    """`grpc.health.v1.Health` as `/health` answers: SERVING when the service is healthy (its probe passes, not
    draining), NOT_SERVING otherwise; for the whole server (`""`) and the encoder service, NOT_FOUND for any
    other name. `Watch` sends the status now, then NOT_SERVING once draining begins."""

    def __init__(self, service: EncoderService) -> None:
        self.service = service
        self.draining = asyncio.Event()
        service.on_drain(self.draining.set)

    def status(self, name: str) -> int | None:
        if name not in ("", ENCODER_SERVICE):
            return None
        healthy, _ = self.service.healthy()
        return health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request, context):  # noqa: N802
        status = self.status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}: ask for '' or "
                                                           f"{ENCODER_SERVICE!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):  # noqa: N802
        status = self.status(request.service)
        if status is None:
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            return
        yield health_pb2.HealthCheckResponse(status=status)
        if status == health_pb2.HealthCheckResponse.SERVING:
            await self.draining.wait()
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
