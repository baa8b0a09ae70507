"""vLLM's `ECCPUConnector` in its P2P mode, producer role: items kept in NIXL-registered memory that consumers read.

The protocol of vLLM 0.32 and 0.33 (the same in both: `ec_connector/cpu/`: `protocol.py`, `session.py`'s
`ProducerSession`, the scheduler's `request_finished`), as an EPD proxy drives an encoder instance and the consumer
then reads:

1. The proxy sends the encoder request; each item is identified and encoded (or found in the shared tier)
   by `producer.VllmProducer.rows` and its rows are copied into blocks of the registered pool
   (`transport.nixl.NixlBlockPool`), in blocks of the consumer's block size (the language model's hidden
   size times the element size: one row per block where the rows are that wide).
2. The answer's `ec_transfer_params` names each item as vLLM's producer does: `{identifier: {"modality" (0.33),
   "metadata", "item_indices", "peer_host", "peer_port", "size_bytes", "shape"}}`, `size_bytes` being the
   whole blocks and `shape` the rows' `[rows, width]`.
3. The consumer's scheduler sends an `XferReq` (msgpack, `{"type": "req", "mm_hash", "compatibility_hash",
   "session_id", "connector_version"}`, defaults omitted) from a DEALER socket to this side channel's
   ROUTER (`--ec-side-channel-host`/`-port`, vLLM's `VLLM_EC_SIDE_CHANNEL_HOST`/`_PORT`).
4. The answer is an `XferAck` (`{"type": "ack", "mm_hash", "status", ...}`): `OK` with the item's block
   indices, this agent's NIXL metadata and the pool's per-block descriptors, the item pinned for the
   consumer's read; or a NACK: `VERSION` for another connector version, `INCOMPAT` for another
   compatibility hash (sha256 of `[vllm_version, model, dtype, block_size]`), `INTERNAL` without a
   session id, `MISSING` for an item the pool does not hold, `NOT_READY` for one still being copied in
   (the consumer asks again).
5. The consumer READs the blocks with NIXL and sends the notification `"{session_id}:{mm_hash}"`; the pin
   ends there. A session that has completed a read has registered this agent (whose metadata never
   changes), so its later acks leave the descriptors out (msgspec's default, empty): vLLM's consumer reads
   them only when it registers a producer, and for a pool of gigabytes they are megabytes per ack. A pin
   whose notification does not come within `producer_pin_lease_s` (vLLM's 30 s) ends
   anyway, counted as a failure: a consumer that dies mid-read holds its own items only that long, and
   nobody else's. A second request for a pin it still holds replaces it, as vLLM's producer does.

Malformed requests are dropped unanswered, as vLLM's producer drops them. The side channel's thread is
the only one that calls the NIXL agent after start-up.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import zmq

from encode_server.fronts.vllm.connectors.base import Connector, ItemRows, transfer_params
from encode_server.fronts.vllm.transfer_config import ECTransferConfig
from encode_server.fronts.vllm.versions import VllmVersion
from encode_server.records import EncodeError
from encode_server.transport.nixl import NixlBlockPool
from encode_server.transport.registered import RegistrationRefused

log = logging.getLogger("encode_server.fronts.vllm.connectors.cpu")

#: vLLM 0.33's `EC_CONNECTOR_VERSION`: a request naming another version is answered `NACK_VERSION`.
CONNECTOR_VERSION = 2
#: vLLM's `XferStatus`.
OK, NACK_MISSING, NACK_INCOMPAT, NACK_VERSION, NACK_INTERNAL, NACK_NOT_READY = range(6)
#: Threads copying rows into the pool at once.
COPY_THREADS = 4
#: Consumer sessions remembered as having registered this agent (their acks carry no descriptors).
SESSIONS_KEPT = 4096
WILDCARDS = ("0.0.0.0", "::", "*", "")


def compatibility_hash(vllm_version: str, model: str, dtype: str, block_size: int) -> str:
    """vLLM's `compute_ec_compatibility_hash`: sha256 of the compact JSON `[version, model, dtype, block size]`."""
    factors = json.dumps([vllm_version, model, dtype, block_size], separators=(",", ":"))
    return hashlib.sha256(factors.encode("utf-8")).hexdigest()


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


#: How long after a grant the side channel advances the agent without pause (a loopback or TCP read of tens of MiB
#: ends well within it); after it, once a millisecond until the consumer's notification or the lease.
READ_SPIN_S = 0.5


@dataclass
class _Grant:
    mm_hash: str
    deadline: float
    started: float
    nbytes: int


class ECCPUConnector(Connector):
    """The producer side of `ECCPUConnector` in P2P mode; see the module docstring."""

    name = "ECCPUConnector"

    def __init__(self, config: ECTransferConfig, family: str, hidden_size: int, dtype: torch.dtype, model: str,
                 version: VllmVersion, host: str, port: int) -> None:
        if host in WILDCARDS:
            raise ValueError(f"ECCPUConnector: --ec-side-channel-host {host!r} is a wildcard, but consumers are told "
                             f"this address to reach the encoder at: give that address")
        self.config = config
        self.family = family
        self.version = version
        self.dtype = dtype
        self.host, self.port = host, port
        self.block_size = int(hidden_size) * torch.empty(0, dtype=dtype).element_size()
        self.factors = [version.text, model, str(dtype), self.block_size]
        self.compat_hash = compatibility_hash(*self.factors)
        self.pool = NixlBlockPool(config.engine_id or f"encode-server-{uuid.uuid4()}", self.block_size,
                                  config.cpu_bytes, progress_thread=config.progress_thread)
        self._grants: dict[str, _Grant] = {}  # "{session_id}:{mm_hash}" -> the pin held for that read
        self._grants_lock = threading.Lock()
        self._registered: OrderedDict[str, None] = OrderedDict()  # sessions that completed a read (side channel's)
        self._copies = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="ec-cpu-copy")
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(zmq_address(host, port))
        except zmq.ZMQError as exc:
            self._router.close(0)
            self._context.term()
            self._copies.shutdown()
            self.pool.close()
            raise ValueError(f"ECCPUConnector: the side channel cannot listen on {host}:{port} ({exc}): set "
                             f"--ec-side-channel-host/-port (VLLM_EC_SIDE_CHANNEL_HOST/_PORT)") from None
        self.malformed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ec-cpu-side-channel", daemon=True)
        self._thread.start()
        log.info("ECCPUConnector producer: side channel %s:%d, agent %s, %d-byte blocks, compatibility %s",
                 host, port, self.pool.agent_name, self.block_size, self.factors)

    @classmethod
    def from_config(cls, config: Any, service: Any, settings: Any, version: VllmVersion) -> ECCPUConnector:
        info = service.adapter.info
        return cls(config, info.family, info.hidden_size, service.adapter.dtype, settings.ec_identifier_model,
                   version, settings.ec_side_channel_host, settings.ec_side_channel_port)

    # --- what it shows ------------------------------------------------------------------------------

    @property
    def stats(self):
        return self.pool.stats

    @property
    def registered_bytes(self) -> int:
        return self.pool.registered_bytes

    @property
    def held_bytes(self) -> int:
        return self.pool.held_bytes

    @property
    def open_reservations(self) -> int:
        """Reads granted and not notified or lapsed yet."""
        with self._grants_lock:
            return len(self._grants)

    def info(self) -> dict[str, Any]:
        """What `/server_info` shows of this transport."""
        return {"connector": self.config.connector, "role": self.config.role, "mode": "p2p (nixl)",
                "peer_host": self.host, "peer_port": self.port, "agent": self.pool.agent_name,
                "block_size_bytes": self.block_size, "compatibility": self.factors,
                "registered_bytes": self.pool.registered_bytes, "held_bytes": self.pool.held_bytes,
                "stored_bytes": self.pool.stored_bytes, "items": self.pool.items,
                "open_reservations": self.open_reservations, **self.stats.as_json()}

    # --- the encoder's answer -----------------------------------------------------------------------

    async def hand_over(self, items: list[ItemRows], params: Any, request_id: str) -> dict[str, Any]:
        """Every item's rows into the pool; the answer's `ec_transfer_params`. In vLLM's P2P flow the proxy sends
        the encoder no `ec_transfer_params`, and any it sends are not read. `EncodeError` on failure."""
        unique: dict[str, ItemRows] = {}
        for item in items:
            unique.setdefault(item.identifier, item)
        loop = asyncio.get_running_loop()
        for item in unique.values():
            if item.rows is None or item.rows.dtype != self.dtype or item.rows.dim() != 2:
                shape = "no" if item.rows is None else f"{item.rows.dtype} {list(item.rows.shape)}"
                raise EncodeError(500, f"ECCPUConnector: {item.identifier} has {shape} rows, the transport carries "
                                       f"2-D {self.dtype}", request_id)
        try:
            entries = await asyncio.gather(*(loop.run_in_executor(self._copies, self.pool.put, identifier, item.rows,
                                                                  self.config.hold_s)
                                             for identifier, item in unique.items()))
        except RegistrationRefused as refused:
            raise EncodeError(503, f"ECCPUConnector: {refused}", request_id,
                              headers={"Retry-After": str(refused.retry_after_s)}) from None
        blocks = {identifier: entry for identifier, entry in zip(unique, entries)}
        return transfer_params(items, self.family, self.version, lambda item: {
            "peer_host": self.host, "peer_port": self.port,
            "size_bytes": len(blocks[item.identifier].block_ids) * self.block_size,
            "shape": [int(size) for size in item.rows.shape]})

    # --- the side channel (its own thread) ----------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                # While reads are granted the agent's progress (over TCP, a READ advances only with it) comes
                # from here: as often as the thread gets to run for a read granted in the last READ_SPIN_S, every
                # millisecond for an older one (its consumer may be gone: it waits for the lease, not spinning);
                # idle, a request wakes the poll at once.
                reading, waiting = self._reads_in_progress()
                if dict(poller.poll(0 if reading else 1 if waiting else 20)).get(self._router):
                    self._answer_all()
                self._drain_notifications()
                self._sweep()
                if reading:
                    time.sleep(0)  # lets the server's other threads take the GIL between two calls into the agent
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - the side channel must outlive any one bad exchange
                log.exception("ECCPUConnector: side channel step failed")

    def _reads_in_progress(self) -> tuple[bool, bool]:
        """(a read granted within READ_SPIN_S, any read granted and not yet done)."""
        now = time.monotonic()
        with self._grants_lock:
            return any(now - grant.started < READ_SPIN_S for grant in self._grants.values()), bool(self._grants)

    def _answer_all(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"":
                self.malformed += 1
                continue
            ack = self.answer(frames[2])
            if ack is not None:
                self._router.send_multipart([frames[0], b"", msgpack.packb(ack)])

    def answer(self, payload: bytes) -> dict[str, Any] | None:
        """The `XferAck` for one `XferReq` (None: malformed, dropped)."""
        try:
            request = msgpack.unpackb(payload, raw=False)
        except Exception:  # noqa: BLE001 - any undecodable payload is malformed
            request = None
        if not isinstance(request, dict) or request.get("type") != "req" \
                or not isinstance(request.get("mm_hash"), str) \
                or not isinstance(request.get("compatibility_hash"), str) \
                or not isinstance(request.get("session_id", ""), str) \
                or not isinstance(request.get("connector_version", CONNECTOR_VERSION), int):
            self.malformed += 1
            log.warning("ECCPUConnector: dropped a malformed XferReq")
            return None
        mm_hash = request["mm_hash"]
        if request.get("connector_version", CONNECTOR_VERSION) != CONNECTOR_VERSION:
            log.warning("ECCPUConnector: a consumer speaks connector version %s (this producer: %d) for %s",
                        request.get("connector_version"), CONNECTOR_VERSION, mm_hash)
            return {"type": "ack", "mm_hash": mm_hash, "status": NACK_VERSION}
        if request["compatibility_hash"] != self.compat_hash:
            log.warning("ECCPUConnector: a consumer's compatibility hash differs for %s: this producer hashes %s "
                        "(vLLM version --ec-vllm-version, model --ec-model-id, --dtype, block size); the consumer's "
                        "must be the same", mm_hash, self.factors)
            return {"type": "ack", "mm_hash": mm_hash, "status": NACK_INCOMPAT}
        session = request.get("session_id", "")
        if not session:
            return {"type": "ack", "mm_hash": mm_hash, "status": NACK_INTERNAL}
        entry = self.pool.pin(mm_hash)
        if entry is None:
            return {"type": "ack", "mm_hash": mm_hash, "status": NACK_MISSING}
        if entry is False:
            return {"type": "ack", "mm_hash": mm_hash, "status": NACK_NOT_READY}
        key = f"{session}:{mm_hash}"
        now = time.monotonic()
        with self._grants_lock:
            previous = self._grants.pop(key, None)
            self._grants[key] = _Grant(mm_hash, now + self.config.pin_lease_s, now,
                                       len(entry.block_ids) * self.block_size)
        if previous is not None:
            self.pool.unpin(previous.mm_hash, read=False)
        ack = {"type": "ack", "mm_hash": mm_hash, "status": OK, "session_id": session,
               "src_block_indices": list(entry.block_ids), "agent_metadata": self.pool.agent_metadata}
        if session not in self._registered:
            ack["mem_descriptor"] = self.pool.mem_descriptor
        return ack

    def _drain_notifications(self) -> None:
        now = time.monotonic()
        for messages in self.pool.notifications().values():
            for message in messages:
                try:
                    key = message.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                with self._grants_lock:
                    grant = self._grants.pop(key, None)
                if grant is not None:
                    self.pool.unpin(grant.mm_hash, read=True)
                    self.stats.transferred(grant.nbytes, now - grant.started)
                    self._registered[key.partition(":")[0]] = None
                    self._registered.move_to_end(key.partition(":")[0])
                    while len(self._registered) > SESSIONS_KEPT:
                        self._registered.popitem(last=False)

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._grants_lock:
            lapsed = [key for key, grant in self._grants.items() if now > grant.deadline]
            grants = [self._grants.pop(key) for key in lapsed]
        for key, grant in zip(lapsed, grants):
            log.warning("ECCPUConnector: no notification for the read %s within %g s; its pin is released", key,
                        self.config.pin_lease_s)
            self.pool.unpin(grant.mm_hash, read=False)
            self.stats.failed()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._copies.shutdown(wait=True, cancel_futures=True)
        self._router.close(0)
        self._context.term()
        with self._grants_lock:
            self._grants.clear()
        self.pool.close()
