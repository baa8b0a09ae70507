"""Admission: which `/encode` bodies get in, and the bookkeeping of those that did.

`Admission.validate` turns a JSON body into an `EncodeRequest` and its destinations (400 naming
what is wrong). `Admission.admit` lets a request in, or refuses it: 503 when the server is broken,
draining or holding `--max-pending` requests, 409 when the same (`req_id`, `part_idx`) is already in
flight. An admitted request holds a `Ticket` (its deadline, and the status it ends with); leaving
the `admit` block releases it exactly once and records its outcome, whatever happened inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from encode_server.admission.schemas import EncodeRequest, describe_validation_error, request_id_of
from encode_server.delivery.sockets import endpoint_for
from encode_server.models import EncoderAdapter
from encode_server.ops.metrics import ServerMetrics
from encode_server.ops.settings import Settings
from encode_server.records import EncodeError, PartMeta
from encode_server.scheduling.clock import Clock

log = logging.getLogger("encode_server.admission.gate")

#: the fields `/encode` reads, and those SGLang's encoder requests carry that it does not need; any other is
#: ignored too, and said once (docs/CONTRACT.md, section 2)
ENCODE_FIELDS = frozenset(EncodeRequest.model_fields) | {"encoder_idx", "encoder_url", "time_stats_json"}
_warned_fields: set[str] = set()


def warn_unknown_fields(fields: set[str], req_id: str) -> None:
    """Say once per field name that `/encode` ignored it, so that a misplaced option is not silently lost."""
    new = sorted(fields - _warned_fields)
    if not new:
        return
    _warned_fields.update(new)
    log.warning("POST /encode ignored the field%s %s (req_id=%s; said once per field name): /encode reads only %s",
                "s" if len(new) > 1 else "", ", ".join(repr(name) for name in new), req_id,
                ", ".join(EncodeRequest.model_fields))


@dataclass
class Ticket:
    """An admitted request: when it must be answered by, and how it ended (a metrics label)."""

    started: float  # in the clock of `Admission`
    timeout_s: float
    status: str = "500"  # until the request says otherwise

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s


def unsupported_modality_message(adapter: EncoderAdapter, modality: str) -> str:
    """Why this server refuses `modality`, and which models (built-in ones first) encode it."""
    from encode_server.models.registry import families_encoding

    message = (f"model {adapter.info.name!r} does not encode {modality} "
               f"(it encodes: {', '.join(adapter.info.modalities)})")
    families = families_encoding(modality)
    if not families:
        return message
    builtins = [name for family in families for name in family.builtins]
    which = (f"the family {families[0].name}" if len(families) == 1
             else f"the families {', '.join(family.name for family in families)}")
    start = f"--model {' or '.join(builtins)}, or with " if builtins else "--model "
    return (f"{message}; {modality} is encoded by {which}: send it to an encoder started with {start}"
            f"a checkpoint folder of {'that family' if len(families) == 1 else 'one of them'}")


class Admission:
    """Validates requests, admits them or refuses them, and counts those in flight."""

    def __init__(self, settings: Settings, adapter: EncoderAdapter, metrics: ServerMetrics, clock: Clock,
                 evict: Callable[[int], bool] | None = None) -> None:
        self.settings = settings
        # At --max-pending, `evict(priority)` may fail a queued request of lower priority to make room.
        self.evict = evict
        self.adapter = adapter
        self.metrics = metrics
        self.clock = clock
        self.broken: str | None = None  # why the server can no longer encode (a tensor-parallel rank died)
        self.draining = False
        self._in_flight: set[tuple[str, int]] = set()
        self._drained = asyncio.Event()
        self.metrics.pending.set_function(lambda: len(self._in_flight))  # read at each scrape

    @property
    def pending(self) -> int:
        return len(self._in_flight)

    # --- validation ------------------------------------------------------------------------------

    def validate(self, payload: Any) -> tuple[EncodeRequest, PartMeta, list[str]]:
        """The request, which part it is, and the `tcp://` destinations it names; 400 when malformed."""
        if not isinstance(payload, dict):
            raise EncodeError(400, f"the body must be a JSON object, got {type(payload).__name__}")
        try:
            request = EncodeRequest.model_validate(payload)
        except ValidationError as exc:
            raise EncodeError(400, describe_validation_error(exc), request_id_of(payload)) from None
        if payload.keys() - ENCODE_FIELDS:
            warn_unknown_fields(payload.keys() - ENCODE_FIELDS, request.req_id)
        if not self.adapter.supports(request.modality):
            raise EncodeError(400, unsupported_modality_message(self.adapter, request.modality), request.req_id)
        if request.timeout_s is not None and request.timeout_s > self.settings.req_timeout_s:
            raise EncodeError(400, f"timeout_s {request.timeout_s:g} is above the server's limit of "
                                   f"{self.settings.req_timeout_s:g} s (--req-timeout-s)", request.req_id)
        if request.priority > self.settings.max_priority:
            raise EncodeError(400, f"priority: must be at most {self.settings.max_priority} (--max-priority), "
                                   f"got {request.priority}", request.req_id)
        meta = PartMeta(req_id=request.req_id, part_idx=request.part_idx, num_parts=request.num_parts,
                        modality=request.modality)
        return request, meta, self._endpoints(request)

    @staticmethod
    def _endpoints(request: EncodeRequest) -> list[str]:
        ports = request.embedding_port
        if ports is None:  # with prefill_host: SGLang's zmq_to_scheduler form, its ranks register (delivery)
            return []
        if request.prefill_host is None:
            raise EncodeError(400, "embedding_port needs prefill_host", request.req_id)
        ports = [ports] if isinstance(ports, int) else ports
        if not ports:
            raise EncodeError(400, "embedding_port: an empty list names no destination", request.req_id)
        try:
            return list(dict.fromkeys(endpoint_for(request.prefill_host, port) for port in ports))
        except ValueError as exc:
            raise EncodeError(400, f"prefill_host/embedding_port: {exc}", request.req_id) from None

    # --- admission -------------------------------------------------------------------------------

    def refusal(self) -> EncodeError | None:
        """Why no request can be admitted now (broken or draining), if so."""
        if self.broken:
            return EncodeError(503, self.broken, headers={"Retry-After": "5"})
        if self.draining:
            return EncodeError(503, "the server is draining before shutdown", headers={"Retry-After": "1"})
        return None

    @contextlib.contextmanager
    def admit(self, request: EncodeRequest, front: str = "http") -> Iterator[Ticket]:
        """Admit a request for the duration of the block, or raise its 503/409. `front`: the door it came in by,
        for the metrics (`ops.metrics.FRONTS`)."""
        key = (request.req_id, request.part_idx)
        error = self.refusal()
        if error is None and len(self._in_flight) >= self.settings.max_pending and (
                key in self._in_flight or not self._evicted_for(request)):
            error = EncodeError(503, f"overloaded: {self.settings.max_pending} requests pending (--max-pending); "
                                     "retry after Retry-After, or add encoders",
                                headers={"Retry-After": "1"})
        if error is None and key in self._in_flight:
            error = EncodeError(409, f"req_id {request.req_id!r} part {request.part_idx} is already in flight: "
                                     "each request part needs its own (req_id, part_idx) while it runs")
        if error is not None:
            error.req_id = request.req_id
            self.metrics.answered(request.modality, front, str(error.status))
            raise error
        timeout = min(request.timeout_s or self.settings.req_timeout_s, self.settings.req_timeout_s)
        ticket = Ticket(started=self.clock.now(), timeout_s=timeout)
        self._in_flight.add(key)
        try:
            yield ticket
        finally:
            self._in_flight.discard(key)
            if self.draining and not self._in_flight:
                self._drained.set()
            self.metrics.answered(request.modality, front, ticket.status)
            elapsed = self.clock.now() - ticket.started
            self.metrics.request_duration.labels(request.modality, str(request.priority)).observe(elapsed)
            log.debug("request req_id=%s part=%d modality=%s items=%d status=%s duration_ms=%.1f",
                      request.req_id, request.part_idx, request.modality, len(request.mm_items), ticket.status,
                      elapsed * 1e3)

    def _evicted_for(self, request: EncodeRequest) -> bool:
        """At the cap, a request of priority above 0 may take the place of a queued lower-priority one."""
        return request.priority > 0 and self.evict is not None and self.evict(request.priority)

    # --- draining --------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Stop admitting: new requests get 503; those in flight go on."""
        self.draining = True
        if not self._in_flight:
            self._drained.set()

    async def wait_drained(self, timeout: float) -> bool:
        """True when every admitted request has left within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
