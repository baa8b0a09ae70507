"""vLLM's `ECMooncakeConnector`, producer role: each item's rows pushed into the consumer's reserved buffer.

The protocol of vLLM 0.32 and 0.33 (the same in both: `ec_connector/mooncake/`, its scheduler, worker and control
plane) as its EPD proxy drives an encoder instance:

1. The proxy sends each encoder request with `ec_transfer_params = {"consumer_zmq": "tcp://host:port",
   "ec_items": [{"transfer_id": ...}, ...]}`, one entry per media item, by position.
2. The items are identified and encoded (or found in the shared tier) by `producer.VllmProducer.rows`.
3. The consumer's control socket (`mooncake_control`) is asked for its ranks (`peers`); every rank gets one
   `reserve_batch` with each item's `transfer_id`, `mm_hash` (the identifier), `nbytes`, `shape` and
   `dtype`, and answers each with a reservation: `reservation_id`, `dst_session`, `dst_ptr`, `nbytes`,
   and `write` / `cached` / `cancelled`.
4. The rows are registered with the TransferEngine (within the registered-memory bound) and written
   row-major to every reservation that asks for a write (`write` true, not `cached`, not `cancelled`),
   one synchronous batch per destination session.
5. Each rank is told what landed with one `complete_batch` (the written and the `cached` reservations;
   a reservation that follows another writer of the same item is neither written nor completed, as
   vLLM's producer does); an answer that does not say `completed` for a written item fails it.
6. A transfer id pushed already (a retried request) is not pushed again: vLLM's producer keeps its finished
   pushes for the same reason, and a second reservation would only hold the consumer's copy until it expires.
   The same id naming another item or consumer is a 409.
7. On any failure every reservation taken is cancelled (`cancel` with `abandon`), the registration is
   released, and the request fails with an OpenAI error: 503 with Retry-After when the consumer's
   buffer or our registered-memory bound is full, 502 when the consumer is gone or refuses.

The answer names each item as vLLM's producer does in its `ec_transfer_params`: `{identifier:
{"modality", "metadata", "item_indices", "transfer_id"}}`, where `metadata` holds the placeholder fields
the consumer's model sizes the item with (the grid, or an audio clip's rows), so the proxy can send the
consumer a metadata-only item.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from encode_server.fronts.vllm.connectors.base import Connector, ItemRows, transfer_params
from encode_server.fronts.vllm.connectors.mooncake_control import ControlClient, ControlError
from encode_server.fronts.vllm.transfer_config import ECTransferConfig
from encode_server.fronts.vllm.versions import NEWEST, VllmVersion
from encode_server.records import EncodeError
from encode_server.transport.mooncake import MooncakeEngine
from encode_server.transport.registered import RegistrationRefused

log = logging.getLogger("encode_server.fronts.vllm.connectors.mooncake")

_CONSUMER = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
#: Worker threads pushing at once (each holds one request's control exchanges and writes).
PUSH_THREADS = 16
#: Transfer ids remembered as pushed (vLLM's producer keeps 65536 finished pushes).
PUSHED_KEPT = 1 << 16


def check_consumer_address(address: Any) -> str:
    """`consumer_zmq` as vLLM names a consumer's control socket: tcp://host:port."""
    if not isinstance(address, str) or not _CONSUMER.match(address) or not 0 < int(address.rsplit(":", 1)[1]) < 65536:
        raise ValueError(f"ec_transfer_params.consumer_zmq must be a consumer's control address tcp://host:port, "
                         f"got {address!r}")
    return address


def transfer_ids(params: Any, count: int, request_id: str) -> tuple[str, list[str]]:
    """The consumer address and each item's transfer id from the request's `ec_transfer_params` (an item
    without one gets `{request_id}:{index}`, as vLLM's producer names it)."""
    if not isinstance(params, dict) or "consumer_zmq" not in params:
        raise ValueError("an ECMooncakeConnector producer needs ec_transfer_params.consumer_zmq, the consumer's "
                         "control address the proxy names (its --ec-consumer-zmq-addrs)")
    consumer = check_consumer_address(params["consumer_zmq"])
    items = params.get("ec_items") or []
    if not isinstance(items, list):
        raise ValueError("ec_transfer_params.ec_items must be a list of {\"transfer_id\": ...}, one per item")
    ids = []
    for index in range(count):
        entry = items[index] if index < len(items) else {}
        transfer_id = entry.get("transfer_id") if isinstance(entry, dict) else None
        ids.append(str(transfer_id) if transfer_id else f"{request_id}:{index}")
    if len(set(ids)) != len(ids):
        raise ValueError("ec_transfer_params.ec_items: each item needs its own transfer_id")
    return consumer, ids


@dataclass
class _Push:
    transfer_id: str
    item: ItemRows
    rows: torch.Tensor  # contiguous, on the CPU
    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)  # shard address -> its reservation

    @property
    def spec(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "mm_hash": self.item.identifier, "nbytes": self.rows.nbytes,
                "shape": list(self.rows.shape), "dtype": str(self.rows.dtype).removeprefix("torch.")}


class PushFailed(Exception):
    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class ECMooncakeConnector(Connector):
    """The producer side of `ECMooncakeConnector`: reserve, write, complete (or cancel); see the module
    docstring."""

    name = "ECMooncakeConnector"

    def __init__(self, config: ECTransferConfig, family: str, version: VllmVersion = NEWEST) -> None:
        self.config = config
        self.family = family
        self.version = version
        self.engine = MooncakeEngine(config.ip, config.protocol, config.buffer_size, name="ECMooncakeConnector")
        self.control = ControlClient(config.control_timeout_s)
        self._threads = ThreadPoolExecutor(PUSH_THREADS, thread_name_prefix="ec-mooncake-push")
        self._lock = threading.Lock()
        # Transfer ids pushed (or being pushed) -> what was pushed where: the same transfer asked for again (a
        # proxy's retry) is answered without a second reservation, as vLLM's producer keeps its finished pushes.
        self._pushed: OrderedDict[str, tuple] = OrderedDict()
        self.open_reservations = 0  # reservations taken on consumers and not settled yet (completed or cancelled)

    @classmethod
    def from_config(cls, config: Any, service: Any, settings: Any, version: VllmVersion) -> ECMooncakeConnector:
        return cls(config, service.adapter.info.family, version)

    def _opened(self, count: int) -> None:
        with self._lock:
            self.open_reservations += count

    @property
    def stats(self):
        return self.engine.stats

    def info(self) -> dict[str, Any]:
        """What `/server_info` shows of this transport."""
        return {"connector": self.config.connector, "role": self.config.role, "session": self.engine.session,
                "protocol": self.config.protocol, "registered_bytes": self.engine.memory.bytes_held,
                "registered_bytes_bound": self.config.buffer_size, "open_reservations": self.open_reservations,
                **self.stats.as_json()}

    async def hand_over(self, items: list[ItemRows], params: Any, request_id: str) -> dict[str, Any]:
        """Push every item to the consumer the request names; the `ec_transfer_params` of the answer.
        `EncodeError` on failure (nothing stays reserved or registered)."""
        try:
            consumer, ids = transfer_ids(params, len(items), request_id)
        except ValueError as exc:
            raise EncodeError(400, str(exc), request_id) from None
        pushes = [_Push(transfer_id, item, item.rows.detach().to("cpu").contiguous())
                  for transfer_id, item in zip(ids, items)]
        fresh = self._claim(consumer, pushes, request_id)
        try:
            if fresh:
                await asyncio.get_running_loop().run_in_executor(self._threads, self._push, consumer, fresh)
        except PushFailed as failure:
            self._release(fresh)
            headers = {"Retry-After": str(failure.retry_after_s)} if failure.retry_after_s else None
            raise EncodeError(failure.status, str(failure), request_id, headers=headers) from None
        except BaseException:
            self._release(fresh)
            raise
        ids = {push.item.identifier: push.transfer_id for push in pushes}  # the last one, as vLLM's producer
        return transfer_params(items, self.family, self.version, lambda item: {"transfer_id": ids[item.identifier]})

    def _claim(self, consumer: str, pushes: list[_Push], request_id: str) -> list[_Push]:
        """The pushes not pushed yet; a transfer id already pushed (or being pushed) with the same item to the same
        consumer is skipped, one naming another item or consumer is a 409."""
        fresh = []
        with self._lock:
            for push in pushes:
                key = (consumer, push.item.identifier, push.rows.nbytes, tuple(push.rows.shape), str(push.rows.dtype))
                known = self._pushed.get(push.transfer_id)
                if known is None:
                    self._pushed[push.transfer_id] = key
                    fresh.append(push)
                elif known != key:
                    for claimed in fresh:
                        self._pushed.pop(claimed.transfer_id, None)
                    raise EncodeError(409, f"ECMooncakeConnector: transfer_id {push.transfer_id!r} was already pushed "
                                           f"with another item or to another consumer", request_id)
            while len(self._pushed) > PUSHED_KEPT:
                self._pushed.popitem(last=False)
        return fresh

    def _release(self, pushes: list[_Push]) -> None:
        """Forget failed pushes' transfer ids, so that a retry pushes them again."""
        with self._lock:
            for push in pushes:
                self._pushed.pop(push.transfer_id, None)

    # --- in a push thread ------------------------------------------------------------------------

    def _push(self, consumer: str, pushes: list[_Push]) -> None:
        sources = {push.rows.data_ptr(): push.rows.nbytes for push in pushes}
        try:
            pinned = self.engine.memory.pinned(list(sources.items()))
            pinned.__enter__()
        except RegistrationRefused as refused:
            self.stats.refuse(len(pushes))
            raise PushFailed(503, f"ECMooncakeConnector: {refused}", refused.retry_after_s) from None
        try:
            self._reserve(consumer, pushes)
            try:
                self._write(pushes)
                self._complete(pushes)
            except BaseException:
                self._cancel(pushes)
                raise
        except ControlError as exc:
            self.stats.failed(len(pushes))
            raise PushFailed(502, f"ECMooncakeConnector: {exc}") from None
        except ConnectionError as exc:
            raise PushFailed(502, f"ECMooncakeConnector: {exc}") from None
        finally:
            # Reservations that follow another writer of the same item are settled by that writer's completion.
            settled = 0
            for push in pushes:
                for reservation in push.reservations.values():
                    if not reservation.get("done"):
                        reservation["done"] = True
                        settled += 1
            self._opened(-settled)
            pinned.__exit__(None, None, None)

    def _reserve(self, consumer: str, pushes: list[_Push]) -> None:
        """A reservation for every item on every rank; on any refusal, those taken are cancelled."""
        shards = self.control.shards(consumer)
        specs = [push.spec for push in pushes]
        errors = []
        try:
            for shard in shards:
                result = self.control.request(shard, {"op": "reserve_batch", "items": specs})
                answers = result.get("items") if isinstance(result, dict) else None
                if not isinstance(answers, list) or len(answers) != len(pushes):
                    raise ControlError(f"the EC consumer at {shard} answered reserve_batch with {result!r}")
                for push, answer in zip(pushes, answers):
                    if answer.get("ok") and isinstance(answer.get("result"), dict):
                        push.reservations[shard] = answer["result"]
                        if answer["result"].get("cancelled"):
                            answer["result"]["done"] = True
                        else:
                            self._opened(1)
                    else:
                        errors.append(f"{push.item.identifier} on {shard}: {answer.get('error')}")
        except BaseException:
            self._cancel(pushes)
            raise
        if errors:
            self._cancel(pushes)
            full = any("full" in error for error in errors)
            self.stats.failed(len(errors))
            raise PushFailed(503 if full else 502, "ECMooncakeConnector: the consumer refused to reserve "
                             + "; ".join(errors[:4]), 1 if full else None)

    def _write(self, pushes: list[_Push]) -> None:
        by_session: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for push in pushes:
            for shard, reservation in push.reservations.items():
                if not _writable(reservation):
                    continue
                if int(reservation.get("nbytes", -1)) != push.rows.nbytes:
                    raise ControlError(f"the EC consumer at {shard} reserved {reservation.get('nbytes')} bytes for "
                                       f"{push.item.identifier}, whose rows are {push.rows.nbytes} bytes")
                sources, destinations, lengths = by_session.setdefault(str(reservation["dst_session"]), ([], [], []))
                sources.append(push.rows.data_ptr())
                destinations.append(int(reservation["dst_ptr"]))
                lengths.append(push.rows.nbytes)
        for session, (sources, destinations, lengths) in by_session.items():
            self.engine.write(session, sources, destinations, lengths)

    def _complete(self, pushes: list[_Push]) -> None:
        """One `complete_batch` per rank; each written item must be `completed`."""
        shards = {shard for push in pushes for shard in push.reservations}
        for shard in sorted(shards):
            told = [(push, push.reservations[shard]) for push in pushes if shard in push.reservations
                    and (_writable(push.reservations[shard]) or push.reservations[shard].get("cached"))]
            if not told:
                continue
            result = self.control.request(shard, {"op": "complete_batch", "items": [
                {"transfer_id": push.transfer_id, "reservation_id": reservation["reservation_id"]}
                for push, reservation in told]})
            answers = result.get("items") if isinstance(result, dict) else None
            if not isinstance(answers, list) or len(answers) != len(told):
                raise ControlError(f"the EC consumer at {shard} answered complete_batch with {result!r}")
            lost = [push.item.identifier for (push, reservation), answer in zip(told, answers)
                    if _writable(reservation) and not answer.get("completed")]
            for push, _ in told:
                push.reservations[shard]["done"] = True
            self._opened(-len(told))
            if lost:
                raise ControlError(f"the EC consumer at {shard} no longer held the reservations of {', '.join(lost)} "
                                   f"(expired or cancelled before the write completed)")

    def _cancel(self, pushes: list[_Push]) -> None:
        """Abandon every reservation not completed or cancelled yet (best effort: a consumer that is gone
        expires its own, so once a rank does not answer it is not asked again)."""
        gone: set[str] = set()
        for push in pushes:
            for shard, reservation in push.reservations.items():
                if reservation.get("done"):
                    continue
                reservation["done"] = True
                self._opened(-1)
                if shard in gone:
                    continue
                try:
                    self.control.request(shard, {"op": "cancel", "transfer_id": push.transfer_id,
                                                 "reservation_id": str(reservation.get("reservation_id", "")),
                                                 "abandon": True})
                except ControlError as exc:
                    log.warning("could not cancel the reservation of %s on %s: %s", push.item.identifier, shard, exc)
                    if exc.unreachable:
                        gone.add(shard)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.control.close()
        self.engine.close()


def _writable(reservation: dict[str, Any]) -> bool:
    return bool(reservation.get("write", True)) and not reservation.get("cached") and not reservation.get("cancelled")
