"""The vLLM producer: this server as the encoder instance ("E") of vLLM's EPD serving, whichever connector hands
the rows over.

For each media item of a chat-completions body (`chat`: images, videos, audio clips), in order:

1. a part with a `uuid` whose item the connector already keeps for its consumers (`Connector.held`: the shared
   files) or the shared tier holds (`--cache-store`) is a hit, and nothing is fetched or decoded;
2. the item's bytes (a `data:` URL's payload, or an http(s) URL's body through the URL guard);
3. decoded once, as the consumers' vLLM decodes it (`images`, `video`: the frames vLLM's loader for this model
   samples, `audio`: the waveform at the model's rate; `versions`: 0.32 or 0.33), and identified as vLLM
   identifies it (`identifiers`: the uuid, or the hash of the consumer's model id and the item);
4. an identifier the connector keeps or the shared tier holds is a hit (not encoded again, counted);
5. the request's misses go through `EncoderService.encode_identified`, one job per modality, as decoded and
   under their identifiers (admission, the embedding cache, the scheduler, batched with every other request):
   nothing is hashed or decoded a second time in this process (only where items are decoded again in other
   processes, the preprocessing pool or other ranks, do they carry file bytes of vLLM's pixels);
6. what was encoded is published to the shared tier under vLLM's key, whatever the connector.

The items (`connectors.base.ItemRows`: identifier, rows or the held count, layout, where they came from) go
to the connector, which hands them over and writes the answer's `ec_transfer_params`. Any bad item fails the
whole request with a 400 naming it before anything is encoded or handed over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from encode_server.cache.store_tier import StoreTier, row_widths, vllm_namespace
from encode_server.fronts.vllm.audio import Resampler, decode_vllm_audio
from encode_server.fronts.vllm.chat import ChatMediaPart
from encode_server.fronts.vllm.connectors.base import PLACEHOLDER_FIELDS, Connector, ItemRows
from encode_server.fronts.vllm.connectors.example import check_identifier
from encode_server.fronts.vllm.identifiers import (
    EncodedImage,
    EncodedVideo,
    audio_identifier,
    image_identifier,
    video_identifier,
)
from encode_server.fronts.vllm.images import data_url_payload, decode_vllm_image
from encode_server.fronts.vllm.versions import NEWEST, VllmVersion
from encode_server.fronts.vllm.video import (
    UnsupportedVideoLoader,
    decode_vllm_jpeg_frames,
    decode_vllm_video,
    loader_for,
    video_processor_name,
)
from encode_server.media.decoding import MediaError
from encode_server.media.loader import LoadedItem, each_in_order
from encode_server.models.registry import family_named
from encode_server.ops.tracing import CURRENT as CURRENT_TRACE
from encode_server.records import EncodeError
from encode_server.service import EncoderService
from processors.base import ItemLayout
from processors.video_clip import VideoClip

log = logging.getLogger("encode_server.fronts.vllm.producer")


@dataclass(frozen=True)
class _Decoded:
    """An item decoded and identified here, not held anywhere yet: what goes to the encoder."""

    identifier: str
    modality: str
    loaded: LoadedItem
    location: str


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
            raise ValueError(f"the vLLM producer: this LLaVA-OneVision checkpoint says vision_aspect_ratio "
                             f"{ratio!r}, but vLLM 0.33 lays out and counts its rows with 'anyres_max_9' whatever the "
                             f"checkpoint says, so a vLLM consumer would refuse our rows; serve it without a vLLM "
                             f"connector")


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


def _with_layout(hit: ItemRows, layout: ItemLayout) -> ItemRows:
    """A hit with the layout of the item decoded here, where the rows it holds are as many (else without)."""
    return replace(hit, layout=layout) if layout.tokens == hit.rows_count else hit


def _media_type(url: str) -> str:
    """The media type of a `data:` URL, as vLLM's `_load_data_url` reads it (lower-cased)."""
    spec = url[5:].partition(",")[0]
    return spec.rpartition(";")[0].partition(";")[0].lower()


class VllmProducer:
    """Identifies, decodes once and encodes a request's media items as vLLM's consumers expect them; see the
    module docstring."""

    def __init__(self, service: EncoderService, connector: Connector, model_id: str, algorithm: str,
                 version: VllmVersion = NEWEST, video_processor: str | None = None,
                 store: StoreTier | None = None) -> None:
        self.service = service
        self.connector = connector
        self.shared = store  # the shared tier under vLLM's namespace (--cache-store), or None
        self.model_id = model_id
        self.algorithm = algorithm
        self.version = version
        self.video_processor = video_processor
        self.resampler = Resampler()

    @classmethod
    def from_settings(cls, service: EncoderService, settings, connector: Connector,
                      version: VllmVersion) -> VllmProducer:
        """The producer for the served model, handing rows to `connector`."""
        check_vllm_layout(service.adapter)
        log.info("vLLM producer: %s, identifiers of vLLM %s for model %r with %s", connector.name, version.text,
                 settings.ec_identifier_model, settings.ec_hash_algorithm)
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
        return cls(service, connector, settings.ec_identifier_model, settings.ec_hash_algorithm, version,
                   video_processor, store)

    def close(self) -> None:
        self.resampler.close()

    @staticmethod
    def _key(identifier: str) -> tuple[str, str]:
        """An item's key in the embedding cache: vLLM's identifier, apart from the native items' keys."""
        return ("vllm", identifier)

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

    async def rows(self, parts: list[ChatMediaPart], req_id: str, priority: int = 0) -> list[ItemRows]:
        """Every part's identifier and rows (or the count the connector holds), in order: hits taken where they
        are, the misses encoded (an item named twice is encoded once) and published to the shared tier.
        `EncodeError` on failure."""
        for part in parts:
            self._check_modality(part, req_id)
        started = time.perf_counter()
        prepared = await each_in_order([self._prepare(part, req_id) for part in parts])
        trace = CURRENT_TRACE.get()  # None unless this request is traced (ops.tracing)
        if trace is not None:  # fetched, decoded and identified, each item once
            trace.stage("decode", started, time.perf_counter(), {"encoder.req_id": req_id, "encoder.items": len(parts)})
        misses: dict[str, _Decoded] = {}
        for item in prepared:
            if isinstance(item, _Decoded):
                misses.setdefault(item.identifier, item)
        by_modality: dict[str, list[_Decoded]] = {}
        for item in misses.values():
            by_modality.setdefault(item.modality, []).append(item)
        results = await asyncio.gather(*(self._encode(members, req_id if len(by_modality) == 1 else
                                                      f"{req_id}.{modality}", priority)
                                         for modality, members in by_modality.items()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        encoded = {item.identifier: item for result in results for item in result}
        return [encoded[item.identifier] if isinstance(item, _Decoded) else item for item in prepared]

    async def _encode(self, items: list[_Decoded], job_id: str, priority: int) -> list[ItemRows]:
        """One modality's misses as one job; each published to the shared tier."""
        modality = items[0].modality
        try:
            done = await self.service.encode_identified(job_id, modality,
                                                        [self._key(item.identifier) for item in items],
                                                        [item.loaded for item in items], priority)
        except EncodeError as error:  # name the chat part, not the internal job's item
            if len(items) == 1:
                error.message = error.message.replace("mm_items[0]", items[0].location)
            raise
        if self.shared is not None:
            for item, rows in zip(items, done):
                self.shared.publish(item.identifier, rows.rows)
        return [ItemRows(item.identifier, modality, rows.rows, rows.layout) for item, rows in zip(items, done)]

    async def _prepare(self, part: ChatMediaPart, req_id: str) -> ItemRows | _Decoded:
        """Fetch, decode and identify one item; a hit where the connector or the shared tier holds it. A hit is
        still decoded where its URL is given and the consumer's model sizes the item by placeholder metadata: the
        answer then carries that metadata, so the proxy can send the consumer the item by its identifier (without
        it, vLLM's proxy sends the media itself, and a consumer that hashes it may miss)."""
        pool = self.service.media_pool
        loop = asyncio.get_running_loop()
        try:
            hit = None
            if part.uuid is not None:
                check_identifier(part.uuid)
                held = await loop.run_in_executor(pool, self.connector.held, part.uuid)
                hit = ItemRows(part.uuid, part.modality, None, None, "held", held) if held is not None else \
                    await self._from_store(part.uuid, part.modality)
                if hit is not None and (part.url is None or not self._sized_by_metadata(part.modality)):
                    return hit
                if hit is None and part.url is None:
                    raise MediaError(part.location, f"no item is held by the {self.connector.name} or the shared "
                                                    f"tier under uuid {part.uuid!r} and the part has no URL to "
                                                    f"encode it from")
            url = part.url or ""
            if url[:5].lower() == "data:":
                data = None
            elif url[:8].lower().startswith(("http://", "https://")):
                data = await self.service.media.fetch(url, part.location, part.modality)
            else:
                raise MediaError(part.location, "the URL must be an http(s) or data: URL")
            prepared = await loop.run_in_executor(pool, self._identify, part, data)
            if hit is not None:
                return _with_layout(hit, prepared.loaded.layout)
            if part.uuid is None:
                held = await loop.run_in_executor(pool, self.connector.held, prepared.identifier)
                if held is not None:
                    return _with_layout(ItemRows(prepared.identifier, part.modality, None, None, "held", held),
                                        prepared.loaded.layout)
                if self._key(prepared.identifier) not in self.service.cache:  # the local tier before the shared one
                    shared = await self._from_store(prepared.identifier, part.modality)
                    if shared is not None:
                        return _with_layout(shared, prepared.loaded.layout)
            return prepared
        except MediaError as exc:
            raise EncodeError(400, str(exc), req_id) from None
        except ValueError as exc:  # an identifier that cannot name a folder
            raise EncodeError(400, f"{part.location}.uuid: {exc}", req_id) from None

    def _sized_by_metadata(self, modality: str) -> bool:
        """Whether the consumer's model sizes `modality`'s items by placeholder metadata the answer can carry."""
        return (self.service.adapter.info.family, modality) in PLACEHOLDER_FIELDS

    async def _from_store(self, identifier: str, modality: str) -> ItemRows | None:
        """An item the shared tier holds under vLLM's key; None: not there."""
        if self.shared is None:
            return None
        rows = await self.shared.lookup_rows(modality, identifier)
        return None if rows is None else ItemRows(identifier, modality, rows, None, "store")

    def _identify(self, part: ChatMediaPart, data: bytes | None) -> _Decoded:
        """In a media thread: decode as vLLM does, hash, and describe."""
        settings = self.service.settings
        limits = self.service.media.limits
        url = part.url or ""
        with_bytes = self.service.decodes_elsewhere
        if part.modality == "video":
            if data is None and _media_type(url) == "video/jpeg":  # a list of JPEG frames
                data_url_payload(url.partition(",")[0] + ",", part.location)  # vLLM's checks: base64 only
                video = decode_vllm_jpeg_frames(url.partition(",")[2], settings.max_image_pixels, part.location)
            else:
                data = data_url_payload(url, part.location) if data is None else data
                video = decode_vllm_video(data, loader_for(self.video_processor), settings.max_image_pixels,
                                          settings.max_video_frames, part.location,
                                          self.version.counts_frames_by_demuxing)
            identifier = video_identifier(self.algorithm, self.model_id,
                                          EncodedVideo(video.original_bytes, video.frames, video.metadata), part.uuid)
            decode = lambda: VideoClip(video.images(), limits.video_fps, range(len(video.frames)))  # noqa: E731
            raw = video.png_frames if with_bytes else list
        elif part.modality == "audio":
            data = data_url_payload(url, part.location) if data is None else data
            audio = decode_vllm_audio(data, limits.audio_sample_rate, settings.max_audio_seconds, part.location,
                                      self.resampler)
            identifier = audio_identifier(self.algorithm, self.model_id, audio.samples, part.uuid)
            decode = lambda: audio.samples.astype("float32", copy=False)  # noqa: E731
            raw = audio.wav if with_bytes else bytes
        else:
            data = data_url_payload(url, part.location) if data is None else data
            image = decode_vllm_image(data, settings.max_image_pixels, part.location,
                                      self.version.composites_rgb_transparency)
            identifier = image_identifier(self.algorithm, self.model_id, EncodedImage(data, image.io_config),
                                          part.uuid)
            decode = lambda: image.image  # noqa: E731
            raw = (lambda: image.file_bytes(data)) if with_bytes else bytes  # noqa: E731
        check_identifier(identifier)
        decoded = decode()
        try:
            layout = self.service.adapter.processor.item_layout(part.modality, decoded)
        except ValueError as exc:  # encode_server.models.ItemError is a ValueError
            raise MediaError(part.location, str(exc)) from None
        return _Decoded(identifier, part.modality, LoadedItem(decoded, layout, raw()), part.location)
