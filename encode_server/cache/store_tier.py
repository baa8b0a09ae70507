"""The embedding cache's second tier: items' rows shared by every encoder of a pool through Mooncake Store.

The local cache (`embedding_cache`) stays the first tier. An item it misses is asked of the Store (with
a deadline) before anything is decoded or encoded; a hit's rows go into the local tier and answer the
request; a miss is encoded once and published in the background (never delaying the answer).

Two namespaces (`store_format.Namespace`):

- **native** (`/encode`, OpenAI routes): `encode-server@model:...@encoder:<model fingerprint>...`, the
  identifier is the local cache's content key in hex, and each item has a layout object beside its rows;
- **vLLM** (`--ec-storage`): vLLM's own namespace (`embedding@model:...`, `--cache-store-*` settings
  name its parts) with vLLM's item identifiers, rows only, exactly as vLLM's `ECMooncakeConnector`
  (cross-encoder cache) writes and reads them.

Counters live in the connection's `StoreStats`: a hit is an item whose rows (and layout) came back and
checked out; a corrupt object is counted apart (and logged, at a bounded rate), and is a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from encode_server.cache import store_format
from encode_server.cache.embedding_cache import CachedItem
from encode_server.cache.store_client import StoreConfig, StoreConnection
from encode_server.cache.store_format import CorruptObject, Namespace
from encode_server.models import ModelInfo
from encode_server.ops.setting_values import parse_store_url
from encode_server.ops.settings import Settings

log = logging.getLogger("encode_server.cache.store")


class StoreTier:
    """Reads and publishes one model's items under one namespace."""

    def __init__(self, connection: StoreConnection, namespace: Namespace, widths: dict[str, int],
                 layout_type: type | None = None) -> None:
        self.connection = connection
        self.namespace = namespace
        self.widths = widths  # modality -> the row width this model's items have
        self.layout_type = layout_type  # None: rows only (vLLM's namespace)

    @property
    def stats(self):
        return self.connection.stats

    def _rows(self, key: str, value: bytes | None, modality: str) -> torch.Tensor | None:
        if value is None:
            return None
        try:
            return store_format.decode_value(value, self.namespace.dtype, self.widths[modality])
        except CorruptObject as exc:
            self.stats.corrupt += 1
            self.connection.warn("corrupt", "Mooncake Store: object %s is corrupt (%s); encoded instead", key, exc)
            return None

    async def lookup(self, modality: str, identifiers: Sequence[str],
                     timeout_s: float | None = None) -> list[CachedItem | None]:
        """Each item from the Store (rows and layout), or None: encode it."""
        if not identifiers:
            return []
        keys = [self.namespace.key(identifier) for identifier in identifiers]
        layout_keys = [self.namespace.layout_key(identifier) for identifier in identifiers]
        values = await self.connection.get(keys + layout_keys, timeout_s)
        found: list[CachedItem | None] = []
        for index, key in enumerate(keys):
            rows = self._rows(key, values[index], modality)
            layout_value = values[len(keys) + index]
            item = None
            if rows is not None and layout_value is not None:
                try:
                    layout = store_format.decode_layout(layout_value, self.layout_type)
                    if layout.tokens != rows.shape[0]:
                        raise CorruptObject(f"the layout says {layout.tokens} rows, the object holds {rows.shape[0]}")
                    item = CachedItem(rows, layout)
                except CorruptObject as exc:
                    self.stats.corrupt += 1
                    self.connection.warn("corrupt", "Mooncake Store: the layout of %s is corrupt (%s); encoded "
                                         "instead", key, exc)
            elif rows is not None:
                log.debug("Mooncake Store: %s has rows but no layout object; encoded instead", key)
            found.append(item)
            if item is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return found

    async def lookup_rows(self, modality: str, identifier: str, timeout_s: float | None = None) -> torch.Tensor | None:
        """One item's rows in vLLM's namespace, or None."""
        key = self.namespace.key(identifier)
        [value] = await self.connection.get([key], timeout_s)
        rows = self._rows(key, value, modality)
        if rows is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return rows

    def publish(self, identifier: str, rows: torch.Tensor, layout: Any = None) -> bool:
        """Queue one item for the Store (the layout object first, so a reader never finds rows without it). The
        queue's bound is checked before anything is copied: the rows are converted and copied into the object in
        the publishing thread, never on the caller's loop (the rows must not change meanwhile: the cache's and a
        finished batch's never do)."""
        dtype = self.namespace.dtype
        try:
            size = store_format.value_size(rows.shape, dtype)
            objects: list[tuple[str, Any]] = []
            if self.layout_type is not None:
                objects.append((self.namespace.layout_key(identifier), store_format.encode_layout(layout)))
        except ValueError as exc:
            self.connection.warn("unpublishable", "Mooncake Store: item %s not published: %s", identifier, exc)
            self.stats.publish_drops += 1
            return False
        objects.append((self.namespace.key(identifier), lambda: store_format.encode_value(rows.to(dtype))))
        return self.connection.publish(objects, size + sum(len(value) for _, value in objects[:-1]))


def row_widths(info: ModelInfo) -> dict[str, int]:
    """Modality -> the width of the rows a model's `ModelInfo` says it produces (`ModelInfo.row_width_of`)."""
    return {modality: info.row_width_of(modality) for modality in info.modalities}


def store_config(settings: Settings) -> StoreConfig:
    """The connection's settings from the server's (`--cache-store*`)."""
    return StoreConfig(
        master_server_address=parse_store_url(settings.cache_store),
        metadata_server=settings.cache_store_metadata_server, protocol=settings.cache_store_protocol,
        device_name=settings.cache_store_device_name, local_hostname=settings.cache_store_local_hostname,
        global_segment_size=settings.cache_store_global_segment_size,
        local_buffer_size=settings.cache_store_local_buffer_size,
        read_timeout_s=settings.cache_store_timeout_ms / 1e3,
        publish_max_items=settings.cache_store_publish_items, publish_max_bytes=settings.cache_store_publish_bytes)


def native_namespace(settings: Settings, adapter: Any, fingerprint: str) -> Namespace:
    """This server's own namespace for `/encode` items: the model's fingerprint is its encoder part."""
    return Namespace("encode-server", settings.cache_store_model or settings.model, settings.cache_store_revision,
                     fingerprint, adapter.dtype, settings.cache_store_prefix)


def vllm_namespace(settings: Settings, adapter: Any) -> Namespace:
    """vLLM's namespace for the consumer model the `--cache-store-*` and `--ec-model-id` settings describe."""
    encoder = (store_format.VLLM_DEFAULT_ENCODER_HASH if settings.cache_store_encoder_hash == "auto"
               else settings.cache_store_encoder_hash)
    return Namespace("embedding", settings.cache_store_model or settings.ec_identifier_model,
                     settings.cache_store_revision, encoder, adapter.dtype, settings.cache_store_prefix)
