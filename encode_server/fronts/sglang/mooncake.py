"""SGLang's `mooncake` encoder transfer backend, encoder side: rows staged here, pulled by each receiver rank.

The protocol of SGLang 0.5.23 (`disaggregation/encoder/http_server.py`, `server.py`, `runtime.py` and the
receiver's `WaitingRDMARequest` in `receiver.py`), with `--encoder-transfer-backend mooncake` on both sides:

1. The language side's tokenizer posts `/encode` for each part (`req_id` `<rid>_local_part_<i>`, no
   `embedding_port`). As soon as preprocessing knows the part's items' layouts (before the forward),
   its sizes are published: `embedding_size` (bytes), `embedding_len` (rows), `embedding_dim` (row width).
   `/encode` answers once the rows exist, with those three fields added to its usual body; the rows stay
   here, staged.
2. Every receiver rank (each tensor-parallel rank of the language side) asks `/scheduler_receive_meta_data`
   (`req_id`, `part_idx`) and gets the sizes, waiting until they are published (at most the request
   timeout), so it allocates and registers its landing buffer while the tower runs.
3. Each rank then posts `/send` with its TransferEngine `session_id`, the `buffer_address` of the part in
   its buffer, its `prefill_host`/`embedding_port` and `receive_count` (how many ranks will ask). The rows
   (row-major, the server's dtype: run the language model in the same dtype) are written there with the
   TransferEngine, registered for the time of the write within the registered-memory bound (a 503 with
   Retry-After beyond it), and then SGLang's `EmbeddingData` frame without a tensor (`delivery.sglang_wire`:
   the part's grids, shape and dtype) is pushed to the rank's ZMQ socket, as SGLang's encoder does.
4. The staged rows are freed once `receive_count` distinct destinations (`host:port`) have been sent to,
   or `--send-timeout-s` after they were staged, whichever is first; a `/send` after that is a 500 saying
   nothing is staged (SGLang's answer). A failed encode publishes its error, which the pulls answer with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from encode_server.delivery.handover import Destinations, HandedOver, Handover
from encode_server.delivery.sglang_wire import SglangWire
from encode_server.delivery.sockets import EmbeddingSender, check_endpoint
from encode_server.models import EncoderAdapter, ItemLayout
from encode_server.ops.settings import Settings
from encode_server.records import EncodedPart, EncodeError, LayoutsKnown, PartMeta
from encode_server.transport.mooncake import MooncakeEngine
from encode_server.transport.registered import RegistrationRefused

log = logging.getLogger("encode_server.fronts.sglang.mooncake")

NAME = "sglang-mooncake"


@dataclass
class _Staged:
    """One part's state: its sizes (once known), its rows (once encoded), who took them."""

    created: float
    sizes: asyncio.Future  # -> {"embedding_size", "embedding_len", "embedding_dim"}, or an EncodeError
    rows: asyncio.Future  # -> (PartMeta, EncodedPart), or an EncodeError
    done: set[str] = field(default_factory=set)


class SglangMooncakeStager(Handover):
    """The hand-over of `--encoder-transfer-backend mooncake` (see the module docstring): each part's rows
    staged for its receiver ranks to pull. Parts whose caller takes the rows inline (`return_embedding`) go
    to `inline` (the ZMQ delivery) instead, which also hears of every failure."""

    def __init__(self, hostname: str, protocol: str, limit_bytes: int, device_name: str,
                 row_width: Callable[[str], int], dtype: torch.dtype, embedding_class: str, video_fps: float,
                 seconds_per_grid_step: float | None, wait_timeout_s: float, send_timeout_s: float,
                 inline: Handover) -> None:
        self.inline = inline
        self.engine = MooncakeEngine(hostname, protocol, limit_bytes, name=NAME, device_name=device_name)
        self.row_width = row_width  # modality -> row width
        self.dtype = dtype
        self.wire = SglangWire(embedding_class, seconds_per_grid_step, video_fps)
        self.wait_timeout_s = wait_timeout_s
        self.send_timeout_s = send_timeout_s
        self.sender = EmbeddingSender(send_timeout_s)
        self._parts: dict[str, _Staged] = {}
        self._threads = ThreadPoolExecutor(8, thread_name_prefix="sglang-mooncake")
        self._sweeper: asyncio.Task | None = None
        self.open_reservations = 0  # no reservations in this protocol: the receivers own their buffers

    @classmethod
    def from_settings(cls, settings: Settings, adapter: EncoderAdapter, inline: Handover) -> SglangMooncakeStager:
        from encode_server.delivery.sglang_wire import seconds_per_grid_step

        return cls(settings.transfer_host, settings.mooncake_protocol, settings.mooncake_registered_bytes,
                   settings.disaggregation_ib_device or "", adapter.info.row_width_of, adapter.dtype,
                   settings.sglang_embedding_class, settings.video_fps,
                   seconds_per_grid_step(adapter, settings.video_fps), settings.req_timeout_s, settings.send_timeout_s,
                   inline)

    @property
    def stats(self):
        return self.engine.stats

    @property
    def staged_parts(self) -> int:
        return sum(1 for part in self._parts.values() if part.rows.done() and not part.rows.exception())

    def info(self) -> dict[str, Any]:
        return {"backend": "mooncake", "session": self.engine.session, "protocol": self.engine.protocol,
                "registered_bytes": self.engine.memory.bytes_held,
                "registered_bytes_bound": self.engine.memory.limit_bytes, "staged_parts": self.staged_parts,
                **self.stats.as_json()}

    def _part(self, req_id: str) -> _Staged:
        part = self._parts.get(req_id)
        if part is None:
            loop = asyncio.get_running_loop()
            part = _Staged(time.monotonic(), loop.create_future(), loop.create_future())
            self._parts[req_id] = part
            if self._sweeper is None:
                self._sweeper = asyncio.ensure_future(self._sweep())
        return part

    # --- the hand-over, called by the service on the HTTP loop -----------------------------------

    def layouts_known(self, to: Destinations) -> LayoutsKnown | None:
        if to.inline:
            return None
        return lambda layouts: self.publish(to.meta, layouts)

    async def hand_over(self, to: Destinations, part: EncodedPart) -> HandedOver:
        if to.inline:  # rows asked for inline are not staged
            return await self.inline.hand_over(to, part)
        return HandedOver(fields=self.stage(to.meta, part))

    def failed(self, to: Destinations, error: EncodeError) -> None:
        if not to.inline:
            self.fail(to.meta, error)
        self.inline.failed(to, error)

    def publish(self, meta: PartMeta, layouts: Sequence[ItemLayout]) -> None:
        """The part's sizes, from its items' layouts."""
        part = self._part(meta.req_id)
        if part.sizes.done():
            return
        rows = sum(int(layout.tokens) for layout in layouts)
        width = int(self.row_width(meta.modality))
        part.sizes.set_result({"embedding_size": rows * width * self.dtype.itemsize, "embedding_len": rows,
                               "embedding_dim": width})

    def stage(self, meta: PartMeta, encoded: EncodedPart) -> dict[str, int]:
        """Keep the part's rows for its receivers; the fields `/encode` adds to its answer."""
        part = self._part(meta.req_id)
        rows = encoded.embedding.detach().to("cpu").contiguous()
        sizes = {"embedding_size": rows.nbytes, "embedding_len": int(rows.shape[0]),
                 "embedding_dim": int(rows.shape[1])}
        if part.sizes.done() and not part.sizes.exception() and part.sizes.result() != sizes:
            log.error("%s: published sizes %s, encoded %s", meta.req_id, part.sizes.result(), sizes)
        if not part.sizes.done():
            part.sizes.set_result(sizes)
        if not part.rows.done():
            part.rows.set_result((meta, EncodedPart(rows, encoded.layouts, encoded.batch_size)))
        part.created = time.monotonic()  # the send timeout runs from here
        return sizes

    def fail(self, meta: PartMeta, error: EncodeError) -> None:
        part = self._part(meta.req_id)
        for future in (part.sizes, part.rows):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: waiters re-raise it

    # --- the receivers' endpoints ----------------------------------------------------------------

    async def sizes(self, payload: Any) -> dict[str, Any]:
        """`/scheduler_receive_meta_data`: the part's sizes, once published."""
        req_id, part_idx = _field(payload, "req_id", str), _field(payload, "part_idx", int)
        part = self._part(req_id)
        try:
            sizes = await asyncio.wait_for(asyncio.shield(part.sizes), self.wait_timeout_s)
        except asyncio.TimeoutError:
            raise EncodeError(504, "encode metadata not ready", req_id) from None
        return {"req_id": req_id, "part_idx": part_idx, **sizes}

    async def send(self, payload: Any) -> None:
        """`/send`: write the part's rows into the receiver's buffer and tell its socket."""
        req_id = _field(payload, "req_id", str)
        session = _field(payload, "session_id", str)
        address = _field(payload, "buffer_address", int)
        host, port = _field(payload, "prefill_host", str), _field(payload, "embedding_port", int)
        receive_count = payload.get("receive_count") or 1
        if not isinstance(receive_count, int) or isinstance(receive_count, bool) or receive_count < 1:
            raise EncodeError(400, f"receive_count must be a positive integer, got {receive_count!r}", req_id)
        try:
            endpoint = check_endpoint(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}")
        except ValueError as exc:
            raise EncodeError(400, f"prefill_host/embedding_port: {exc}", req_id) from None
        part = self._parts.get(req_id)
        if part is None:
            raise EncodeError(500, f"no staged embedding for req_id={req_id} (already released)", req_id)
        try:
            meta, encoded = await asyncio.wait_for(asyncio.shield(part.rows), self.send_timeout_s)
        except asyncio.TimeoutError:
            raise EncodeError(504, f"the embedding of req_id={req_id} was not ready within --send-timeout-s",
                              req_id) from None
        rows = encoded.embedding
        try:
            await asyncio.get_running_loop().run_in_executor(self._threads, self._write, session, rows, address)
        except RegistrationRefused as refused:
            self.stats.refuse()
            raise EncodeError(503, f"SGLang mooncake backend: {refused}", req_id,
                              headers={"Retry-After": str(refused.retry_after_s)}) from None
        except ConnectionError as exc:
            self._parts.pop(req_id, None)  # as SGLang's encoder: a failed send releases the part
            raise EncodeError(502, f"SGLang mooncake backend: {exc}", req_id) from None
        header = self.wire.header(meta, encoded)
        try:
            await self.sender.send([endpoint], [header])
        except Exception as exc:  # noqa: BLE001 - the receiver's socket is gone: its request fails there
            self.stats.failed()
            self._parts.pop(req_id, None)
            raise EncodeError(502, f"SGLang mooncake backend: the receiver at {endpoint} did not take the "
                                   f"completion frame: {exc}", req_id) from None
        part.done.add(endpoint)
        if len(part.done) >= receive_count:
            self._parts.pop(req_id, None)

    def _write(self, session: str, rows: torch.Tensor, address: int) -> None:
        with self.engine.memory.pinned([(rows.data_ptr(), rows.nbytes)]):
            self.engine.write(session, [rows.data_ptr()], [address], [rows.nbytes])

    async def _sweep(self) -> None:
        """Free parts whose receivers did not all take them within `send_timeout_s` of staging (or, never
        encoded, within the pull's wait and the send timeout of the first word of them)."""
        while True:
            await asyncio.sleep(min(1.0, self.send_timeout_s / 4))
            now = time.monotonic()
            for req_id, part in list(self._parts.items()):
                limit = self.send_timeout_s if part.rows.done() else self.wait_timeout_s + self.send_timeout_s
                if now - part.created > limit:
                    self._parts.pop(req_id, None)
                    if part.rows.done() and not part.rows.exception():
                        log.warning("%s: %d receivers took the staged rows within --send-timeout-s; freed",
                                    req_id, len(part.done))

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._threads.shutdown(wait=True, cancel_futures=True)
        self.sender.close()
        self.engine.close()


def _field(payload: Any, name: str, kind: type) -> Any:
    if not isinstance(payload, dict):
        raise EncodeError(400, f"the body must be a JSON object, got {type(payload).__name__}")
    value = payload.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise EncodeError(400, f"{name} must be {'a string' if kind is str else 'an integer'}, got {value!r}",
                          payload.get("req_id") if isinstance(payload.get("req_id"), str) else None)
    return value
