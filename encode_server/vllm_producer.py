"""The vLLM producer (`--ec-storage`): this server as the encoder instance ("E") of vLLM's EPD serving.

For each media item of a chat-completions body (`admission.chat`), in order:

1. a part with a `uuid` whose item is already stored is a hit, and nothing is fetched;
2. the item's bytes (a `data:` URL's payload, or an http(s) URL's body through the URL guard);
3. decoded as vLLM decodes it (`media.vllm_images`) and identified as vLLM identifies it
   (`delivery.vllm_hash`: the uuid, or the hash of the consumer's model id and the bytes);
4. an identifier already stored is a hit (not encoded again, counted);
5. every miss of the request goes through `EncoderService.encode_rows` as one job: admission, the
   scheduler (batched with every other request) and the engine, from the pixels vLLM decodes;
6. each item's rows are written to the storage (`delivery.ec_storage`: atomically, within the bound).

The answer comes only once every item's file is in place; any bad item fails the whole request with a
400 naming it before anything is encoded or written. An identifier already being encoded for another
request is waited for, not encoded twice.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from encode_server.admission.chat import ChatMediaPart
from encode_server.delivery.ec_storage import ECStorage, check_identifier
from encode_server.delivery.vllm_hash import EncodedImage, image_identifier
from encode_server.media.decoding import MediaError
from encode_server.media.loader import each_in_order
from encode_server.media.vllm_images import data_url_payload, decode_vllm_image
from encode_server.ops.settings import Settings
from encode_server.records import EncodeError
from encode_server.service import EncoderService

log = logging.getLogger("encode_server.vllm_producer")


@dataclass(frozen=True)
class StoredItem:
    """One item of a request, in the storage: its identifier, its rows (None: a stored file whose header
    could not be read) and whether it was there already."""

    identifier: str
    tokens: int | None
    hit: bool


@dataclass(frozen=True)
class _Prepared:
    identifier: str
    hit: bool
    rows: int | None = None  # a hit's rows, from its file's header
    encode_bytes: bytes = b""  # what goes through the native path: the file, or a PNG of vLLM's pixels
    location: str = ""


def check_vllm_layout(adapter) -> None:
    """Refuse a checkpoint whose rows vLLM 0.33 would lay out otherwise than transformers (and so we) do.

    LLaVA-OneVision: vLLM counts placeholders and packs the tile map with `anyres_max_9` whatever the
    checkpoint's `vision_aspect_ratio` says (`LlavaOnevisionProcessingInfo._get_num_unpadded_features`,
    `_merge_image_patch_embeddings`); released checkpoints say `anyres_max_9`, and only then do the rows agree.
    """
    if adapter.info.family == "llava_onevision":
        ratio = getattr(getattr(getattr(adapter, "model", None), "config", None), "vision_aspect_ratio",
                        "anyres_max_9")
        if ratio != "anyres_max_9":
            raise ValueError(f"--ec-storage: this LLaVA-OneVision checkpoint says vision_aspect_ratio {ratio!r}, but "
                             f"vLLM 0.33 lays out and counts its rows with 'anyres_max_9' whatever the checkpoint "
                             f"says, so a vLLM consumer would refuse our rows; serve it without --ec-storage")


class VllmProducer:
    """Stores items' rows where vLLM's `ECExampleConnector` consumers read them; see the module docstring."""

    def __init__(self, service: EncoderService, storage: ECStorage, model_id: str, algorithm: str) -> None:
        self.service = service
        self.storage = storage
        self.model_id = model_id
        self.algorithm = algorithm
        self._inflight: dict[str, asyncio.Future[int]] = {}
        service.metrics.watch_ec_storage(storage)

    @classmethod
    def from_settings(cls, service: EncoderService, settings: Settings) -> VllmProducer:
        check_vllm_layout(service.adapter)
        storage = ECStorage(settings.ec_storage, settings.ec_storage_bytes, settings.ec_storage_min_age_s)
        log.info("vLLM producer: storage %s (bound %s bytes), identifiers for model %r with %s", storage.root,
                 settings.ec_storage_bytes or "no", settings.ec_identifier_model, settings.ec_hash_algorithm)
        return cls(service, storage, settings.ec_identifier_model, settings.ec_hash_algorithm)

    async def store(self, parts: list[ChatMediaPart], req_id: str, priority: int = 0) -> list[StoredItem]:
        """Every part's rows in the storage (encoded unless there already); `EncodeError` on failure."""
        if parts and not self.service.adapter.supports("image"):
            raise EncodeError(400, f"model {self.service.adapter.info.name!r} does not encode images (it encodes: "
                                   f"{', '.join(self.service.adapter.info.modalities)})", req_id)
        prepared = await each_in_order([self._prepare(part, req_id) for part in parts])
        owned: dict[str, tuple[asyncio.Future[int], _Prepared]] = {}
        waited: dict[str, asyncio.Future[int]] = {}
        for item in prepared:
            if item.hit or item.identifier in owned or item.identifier in waited:
                continue
            if item.identifier in self._inflight:
                waited[item.identifier] = self._inflight[item.identifier]
            else:
                future = asyncio.get_running_loop().create_future()
                self._inflight[item.identifier] = future
                owned[item.identifier] = (future, item)
        if owned:
            await self._encode_and_write(owned, req_id, priority)
        tokens = {identifier: future.result() for identifier, (future, _) in owned.items()}
        for identifier, future in waited.items():
            tokens[identifier] = await asyncio.shield(future)
        return [StoredItem(item.identifier, item.rows if item.hit else tokens.get(item.identifier), item.hit)
                for item in prepared]

    async def _prepare(self, part: ChatMediaPart, req_id: str) -> _Prepared:
        """Fetch, decode and identify one item, and look it up in the storage."""
        pool = self.service.media_pool
        loop = asyncio.get_running_loop()
        try:
            if part.uuid is not None:
                check_identifier(part.uuid)
                if await loop.run_in_executor(pool, self.storage.lookup, part.uuid):
                    return _Prepared(part.uuid, hit=True,
                                     rows=await loop.run_in_executor(pool, self.storage.stored_rows, part.uuid))
                if part.url is None:
                    raise MediaError(part.location, f"no item is stored under uuid {part.uuid!r} and the part "
                                                    f"has no image_url to encode it from")
            url = part.url or ""
            if url[:5].lower() == "data:":
                data = None
            elif url[:8].lower().startswith(("http://", "https://")):
                data = await self.service.media.fetch(url, part.location, "image")
            else:
                raise MediaError(part.location, "image_url.url must be an http(s) or data: URL")
            return await loop.run_in_executor(pool, self._identify, part, data)
        except MediaError as exc:
            raise EncodeError(400, str(exc), req_id) from None
        except ValueError as exc:  # an identifier that cannot name a folder
            raise EncodeError(400, f"{part.location}.uuid: {exc}", req_id) from None

    def _identify(self, part: ChatMediaPart, data: bytes | None) -> _Prepared:
        """In a media thread: decode as vLLM does, hash, look up."""
        if data is None:
            data = data_url_payload(part.url or "", part.location)
        image = decode_vllm_image(data, self.service.settings.max_image_pixels, part.location)
        identifier = check_identifier(image_identifier(self.algorithm, self.model_id,
                                                       EncodedImage(data, image.io_config), part.uuid))
        if part.uuid is None and self.storage.lookup(identifier):
            return _Prepared(identifier, hit=True, rows=self.storage.stored_rows(identifier))
        return _Prepared(identifier, hit=False, encode_bytes=data if image.native_equivalent else image.png(),
                         location=part.location)

    async def _encode_and_write(self, owned: dict[str, tuple[asyncio.Future[int], _Prepared]], req_id: str,
                                priority: int) -> None:
        """Encode the request's misses as one job, write each item's rows, and settle their futures."""
        identifiers = list(owned)
        try:
            try:
                part = await self.service.encode_rows(req_id, "image", [owned[i][1].encode_bytes for i in identifiers],
                                                      priority)
            except EncodeError as error:  # name the chat part, not the internal job's item
                for index, identifier in enumerate(identifiers):
                    error.message = error.message.replace(f"mm_items[{index}]", owned[identifier][1].location)
                raise
            pieces, offset = [], 0
            for layout in part.layouts:
                pieces.append(part.embedding[offset:offset + layout.tokens])
                offset += layout.tokens
            await asyncio.get_running_loop().run_in_executor(
                self.service.media_pool, self._write_all, list(zip(identifiers, pieces)))
        except BaseException as exc:
            error = exc if isinstance(exc, EncodeError) else EncodeError(500, f"storing the rows failed: {exc}",
                                                                         req_id)
            for identifier in identifiers:
                future = owned[identifier][0]
                if not future.done():
                    future.set_exception(error)
                    future.exception()  # retrieved: waiters re-raise it, nobody else need
                self._inflight.pop(identifier, None)
            if isinstance(exc, EncodeError):
                raise
            if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
                raise
            log.exception("vLLM producer: storing %d items failed", len(identifiers))
            raise error from None
        for identifier, rows in zip(identifiers, pieces):
            owned[identifier][0].set_result(int(rows.shape[0]))
            self._inflight.pop(identifier, None)

    def _write_all(self, items: list[tuple[str, object]]) -> None:
        for identifier, rows in items:
            self.storage.write(identifier, rows)
