"""The vLLM producer (`--ec-storage`): this server as the encoder instance ("E") of vLLM's EPD serving.

For each media item of a chat-completions body (`chat`: images, videos, audio clips), in order:

1. a part with a `uuid` whose item is already stored is a hit, and nothing is fetched;
2. the item's bytes (a `data:` URL's payload, or an http(s) URL's body through the URL guard);
3. decoded as vLLM decodes it (`images`, `video`: the frames vLLM's loader for
   this model samples, `audio`: the waveform at the model's rate) and identified as vLLM
   identifies it (`identifiers`: the uuid, or the hash of the consumer's model id and the item);
4. an identifier already stored is a hit (not encoded again, counted);
5. the request's misses go through `EncoderService.encode_rows`, one job per modality: admission, the
   scheduler (batched with every other request) and the engine, from what vLLM decodes (lossless PNGs
   of its pixels and frames, a float WAV of its waveform);
6. each item's rows are written to the storage (`example_connector`: atomically, within the bound).

With `--cache-store`, an item the storage lacks is first asked of Mooncake Store under vLLM's own key
(`cache.store_tier`, vLLM's namespace and identifier): a hit is written to the storage, not encoded;
what is encoded is published there in the background, for vLLM encoders and other servers of the pool.

The answer comes only once every item's file is in place; any bad item fails the whole request with a
400 naming it before anything is encoded or written. An identifier already being encoded for another
request is waited for, not encoded twice.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from encode_server.cache.store_tier import StoreTier, row_widths, vllm_namespace
from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio
from encode_server.fronts.vllm.chat import ChatMediaPart
from encode_server.fronts.vllm.example_connector import ECStorage, check_identifier
from encode_server.fronts.vllm.identifiers import (
    EncodedImage,
    EncodedVideo,
    audio_identifier,
    image_identifier,
    video_identifier,
)
from encode_server.fronts.vllm.images import data_url_payload, decode_vllm_image
from encode_server.fronts.vllm.video import (
    UnsupportedVideoLoader,
    decode_vllm_jpeg_frames,
    decode_vllm_video,
    loader_for,
    video_processor_name,
)
from encode_server.media.decoding import MediaError
from encode_server.media.loader import each_in_order
from encode_server.models.registry import family_named
from encode_server.ops.settings import Settings
from encode_server.records import EncodeError
from encode_server.service import EncoderService
from processors.base import ItemLayout

log = logging.getLogger("encode_server.fronts.vllm.producer")


@dataclass(frozen=True)
class StoredItem:
    """One item of a request, in the storage: its identifier, its rows (None: a stored file whose header
    could not be read) and whether it was there already."""

    identifier: str
    tokens: int | None
    hit: bool


@dataclass(frozen=True)
class ItemRows:
    """One item of a request, encoded: its identifier, modality, rows and layout (its grid)."""

    identifier: str
    modality: str
    rows: torch.Tensor
    layout: ItemLayout


@dataclass(frozen=True)
class _Prepared:
    identifier: str
    hit: bool
    rows: int | None = None  # a hit's rows, from its file's header
    modality: str = "image"
    # What goes through the native path: an image file or a PNG of vLLM's pixels; {"frames": [PNG, ...]} of
    # the frames vLLM's loader sampled; a float WAV of vLLM's waveform.
    encode_item: bytes | dict = b""
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


#: (family, modality) pairs whose items vLLM 0.33 splits, samples or lays out otherwise than this server, so that
#: a consumer could not load what we would store (found with `tools/compat/vllm_compat.py`): refused with a 400.
LAYOUT_REFUSALS: dict[tuple[str, str], str] = {
    ("kimi_k25", "video"): "vLLM 0.33 splits a Kimi-K2.5 video into 4-frame vision chunks, each an item with its own "
                           "identifier and rows, where this server stores one file per video; run vLLM's own encoder "
                           "for video_url items of this model",
    ("muse_spark", "video"): "vLLM 0.33 samples and lays out Muse Spark videos with its own loader and processor, and "
                             "its placeholder count differs from the rows of this server's video path (12 against 36 "
                             "on a 12-frame clip); run vLLM's own encoder for video_url items of this model",
    ("dots3_note", "video"): "vLLM 0.33 expands a Dots3-Note video into timestamped image and audio parts of its own, "
                             "not one video item; run vLLM's own encoder for video_url items of this model",
}


def vllm_layout_refusal(family: str, modality: str) -> str | None:
    """Why items of `modality` are refused for `family` in this mode (None: they are stored)."""
    return LAYOUT_REFUSALS.get((family, modality))


def _media_type(url: str) -> str:
    """The media type of a `data:` URL, as vLLM's `_load_data_url` reads it (lower-cased)."""
    spec = url[5:].partition(",")[0]
    return spec.rpartition(";")[0].partition(";")[0].lower()


class VllmProducer:
    """Stores items' rows where vLLM's `ECExampleConnector` consumers read them; see the module docstring."""

    def __init__(self, service: EncoderService, storage: ECStorage | None, model_id: str, algorithm: str,
                 video_processor: str | None = None, store: StoreTier | None = None) -> None:
        self.service = service
        self.shared = store  # the shared tier under vLLM's namespace (--cache-store), or None
        self.storage = storage
        self.model_id = model_id
        self.algorithm = algorithm
        self.video_processor = video_processor
        self.resampler = Resampler()
        self._inflight: dict[str, asyncio.Future[int]] = {}
        if storage is not None:
            service.metrics.watch_ec_storage(storage)

    @classmethod
    def from_settings(cls, service: EncoderService, settings: Settings) -> VllmProducer:
        """The producer of `--ec-storage` (with its storage), or of a pushing connector (without one)."""
        check_vllm_layout(service.adapter)
        storage = None
        if settings.ec_storage_folder:
            storage = ECStorage(settings.ec_storage_folder, settings.ec_storage_bytes, settings.ec_storage_min_age_s)
            log.info("vLLM producer: storage %s (bound %s bytes), identifiers for model %r with %s", storage.root,
                     settings.ec_storage_bytes or "no", settings.ec_identifier_model, settings.ec_hash_algorithm)
        video_processor = None
        if service.adapter.supports("video"):
            family = family_named(service.adapter.info.family)
            video_processor = video_processor_name(settings.model, family.model_types[0] if family and
                                                   family.model_types else None)
        store = None
        if service.store is not None:
            store = StoreTier(service.store, vllm_namespace(settings, service.adapter),
                              row_widths(service.adapter.info))
            log.info("vLLM producer: shared tier under %s", store.namespace)
        return cls(service, storage, settings.ec_identifier_model, settings.ec_hash_algorithm, video_processor,
                   store)

    def close(self) -> None:
        self.resampler.close()

    def _check_modality(self, part: ChatMediaPart, req_id: str) -> None:
        info = self.service.adapter.info
        if not self.service.adapter.supports(part.modality):
            raise EncodeError(400, f"{part.location}: model {info.name!r} does not encode {part.modality} items "
                                   f"(it encodes: {', '.join(info.modalities)})", req_id)
        refusal = vllm_layout_refusal(info.family, part.modality)
        if refusal:
            raise EncodeError(400, f"{part.location}: {refusal}", req_id)
        if part.modality == "video" and part.url is not None:
            try:
                loader_for(self.video_processor)
            except UnsupportedVideoLoader as exc:
                raise EncodeError(400, f"{part.location}: {exc}", req_id) from None

    async def store(self, parts: list[ChatMediaPart], req_id: str, priority: int = 0) -> list[StoredItem]:
        """Every part's rows in the storage (encoded unless there already); `EncodeError` on failure."""
        for part in parts:
            self._check_modality(part, req_id)
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
                if self.storage is not None and await loop.run_in_executor(pool, self.storage.lookup, part.uuid):
                    return _Prepared(part.uuid, hit=True,
                                     rows=await loop.run_in_executor(pool, self.storage.stored_rows, part.uuid))
                shared = await self._from_store(part.uuid, part.modality)
                if shared is not None:
                    return shared
                if part.url is None:
                    where = "stored" if self.storage is not None else "encoded by this server"
                    raise MediaError(part.location, f"no item is {where} under uuid {part.uuid!r} and the part "
                                                    f"has no URL to encode it from")
            url = part.url or ""
            if url[:5].lower() == "data:":
                data = None
            elif url[:8].lower().startswith(("http://", "https://")):
                data = await self.service.media.fetch(url, part.location, part.modality)
            else:
                raise MediaError(part.location, "the URL must be an http(s) or data: URL")
            prepared = await loop.run_in_executor(pool, self._identify, part, data)
            if not prepared.hit and part.uuid is None:
                shared = await self._from_store(prepared.identifier, part.modality)
                if shared is not None:
                    return shared
            return prepared
        except MediaError as exc:
            raise EncodeError(400, str(exc), req_id) from None
        except ValueError as exc:  # an identifier that cannot name a folder
            raise EncodeError(400, f"{part.location}.uuid: {exc}", req_id) from None

    async def _from_store(self, identifier: str, modality: str) -> _Prepared | None:
        """An item the shared tier holds, written to the storage as if encoded here; None: not there."""
        if self.shared is None or identifier in self._inflight:
            return None
        rows = await self.shared.lookup_rows(modality, identifier)
        if rows is None:
            return None
        await asyncio.get_running_loop().run_in_executor(self.service.media_pool, self.storage.write, identifier, rows)
        return _Prepared(identifier, hit=True, rows=int(rows.shape[0]))

    def _identify(self, part: ChatMediaPart, data: bytes | None) -> _Prepared:
        """In a media thread: decode as vLLM does, hash, look up."""
        settings = self.service.settings
        url = part.url or ""
        if part.modality == "video":
            if data is None and _media_type(url) == "video/jpeg":  # a list of JPEG frames
                data_url_payload(url.partition(",")[0] + ",", part.location)  # vLLM's checks: base64 only
                video = decode_vllm_jpeg_frames(url.partition(",")[2], settings.max_image_pixels, part.location)
            else:
                data = data_url_payload(url, part.location) if data is None else data
                video = decode_vllm_video(data, loader_for(self.video_processor), settings.max_image_pixels,
                                          settings.max_video_frames, part.location)
            identifier = video_identifier(self.algorithm, self.model_id,
                                          EncodedVideo(video.original_bytes, video.frames, video.metadata), part.uuid)
            encode = lambda: {"frames": video.png_frames()}  # noqa: E731
        elif part.modality == "audio":
            data = data_url_payload(url, part.location) if data is None else data
            rate = self.service.adapter.processor.sampling_rate
            audio = decode_vllm_audio(data, rate, settings.max_audio_seconds, part.location, self.resampler)
            identifier = audio_identifier(self.algorithm, self.model_id, audio.samples, part.uuid)
            encode = audio.wav
        else:
            data = data_url_payload(url, part.location) if data is None else data
            image = decode_vllm_image(data, settings.max_image_pixels, part.location)
            identifier = image_identifier(self.algorithm, self.model_id, EncodedImage(data, image.io_config),
                                          part.uuid)
            encode = (lambda: data) if image.native_equivalent else image.png  # noqa: E731
        check_identifier(identifier)
        if part.uuid is None and self.storage is not None and self.storage.lookup(identifier):
            return _Prepared(identifier, hit=True, rows=self.storage.stored_rows(identifier))
        return _Prepared(identifier, hit=False, modality=part.modality, encode_item=encode(), location=part.location)

    async def _encode_and_write(self, owned: dict[str, tuple[asyncio.Future[int], _Prepared]], req_id: str,
                                priority: int) -> None:
        """Encode the request's misses (one job per modality), write each item's rows, and settle their futures."""
        identifiers = list(owned)
        try:
            by_modality: dict[str, list[str]] = {}
            for identifier in identifiers:
                by_modality.setdefault(owned[identifier][1].modality, []).append(identifier)
            results = await asyncio.gather(*(self._encode_modality(owned, modality, members, req_id, priority)
                                             for modality, members in by_modality.items()),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            rows = {identifier: piece for result in results for identifier, piece, _ in result}
            pieces = [rows[identifier] for identifier in identifiers]
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
            if self.shared is not None:
                self.shared.publish(identifier, rows)
            owned[identifier][0].set_result(int(rows.shape[0]))
            self._inflight.pop(identifier, None)

    async def _encode_modality(self, owned: dict[str, tuple[asyncio.Future[int] | None, _Prepared]], modality: str,
                               identifiers: list[str], req_id: str, priority: int,
                               ) -> list[tuple[str, torch.Tensor, ItemLayout]]:
        """One modality's misses as one job; each item's rows and layout."""
        job_id = req_id if len(owned) == len(identifiers) else f"{req_id}.{modality}"
        try:
            part = await self.service.encode_rows(job_id, modality, [owned[i][1].encode_item for i in identifiers],
                                                  priority)
        except EncodeError as error:  # name the chat part, not the internal job's item
            for index, identifier in enumerate(identifiers):
                error.message = error.message.replace(f"mm_items[{index}]", owned[identifier][1].location)
            raise
        pieces, offset = [], 0
        for layout in part.layouts:
            pieces.append(part.embedding[offset:offset + layout.tokens])
            offset += layout.tokens
        return list(zip(identifiers, pieces, part.layouts))

    async def rows(self, parts: list[ChatMediaPart], req_id: str, priority: int = 0) -> list[ItemRows]:
        """Every part's identifier, rows and layout, encoded through the scheduler (an item named twice is
        encoded once; repeats across requests are the embedding cache's): the source of the pushing
        connectors, which keep no storage of their own. `EncodeError` on failure."""
        for part in parts:
            self._check_modality(part, req_id)
        prepared = await each_in_order([self._prepare(part, req_id) for part in parts])
        unique: dict[str, tuple[None, _Prepared]] = {}
        for item in prepared:
            unique.setdefault(item.identifier, (None, item))
        by_modality: dict[str, list[str]] = {}
        for identifier, (_, item) in unique.items():
            by_modality.setdefault(item.modality, []).append(identifier)
        results = await asyncio.gather(*(self._encode_modality(unique, modality, members, req_id, priority)
                                         for modality, members in by_modality.items()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        encoded = {identifier: (rows, layout) for result in results for identifier, rows, layout in result}
        return [ItemRows(item.identifier, item.modality, *encoded[item.identifier]) for item in prepared]

    def _write_all(self, items: list[tuple[str, object]]) -> None:
        for identifier, rows in items:
            self.storage.write(identifier, rows)
