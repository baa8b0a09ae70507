"""vLLM's `ECExampleConnector`, producer role: the encoder-cache files its consumers read, written atomically and
bounded (`--ec-storage`, or the transfer config's `shared_storage_path`).

Layout (vLLM 0.32 and 0.33, `distributed/ec_transfer/ec_connector/example_connector.py`): each item lives at
`{root}/{identifier}/encoder_cache.safetensors`, one tensor under the key `"ec_cache"`: the item's rows.
A consumer's scheduler asks whether that file exists (`has_cache_item`); its worker then loads it in
place of running its own encoder. So a file must never be seen half-written: each is written to a
temporary name in the item's folder, flushed to disk, and renamed into place (`os.replace`). A 0.32 consumer's
lookup creates the item's folder whether or not the file is there: an empty folder is a miss, and a write goes
into it as into a new one.

vLLM's own producer never deletes anything. This one keeps the storage within `max_bytes` (0: no
bound): beyond it, the items least recently written or hit are deleted, except those written or hit
less than `min_age_s` ago, which a consumer may be about to load (the bound is then exceeded until they
age). Files already there at start-up (ours from before a restart, or vLLM's own producer's) are
counted and ordered by their modification time, which a hit refreshes. Several servers may share one
storage; each bounds the files it wrote, hit or found.

Thread-safe: the service calls it from worker threads (file I/O never runs on the event loop). The answer's
`ec_transfer_params` are vLLM's producer's: each identifier's `item_indices` and placeholder `metadata`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from encode_server.fronts.vllm.connectors.base import Connector, ItemRows, transfer_params
from encode_server.fronts.vllm.versions import VllmVersion

log = logging.getLogger("encode_server.fronts.vllm.connectors.example")

#: The file name and tensor key vLLM's ECExampleConnector reads.
FILE_NAME = "encoder_cache.safetensors"
TENSOR_KEY = "ec_cache"
_TEMP_PREFIX = ".encoder_cache."


@dataclass
class StorageStats:
    writes: int = 0
    hits: int = 0
    evictions: int = 0
    bytes_written: int = 0


@dataclass
class _Entry:
    size: int
    used_at: float  # wall-clock time it was last written or hit


def check_identifier(identifier: str) -> str:
    """An identifier that names exactly one folder under the root (a client's uuid can be anything)."""
    if not identifier or identifier in (".", "..") or "/" in identifier or "\\" in identifier or "\0" in identifier:
        raise ValueError(f"identifier {identifier[:64]!r} cannot name a folder of the storage: it must be a "
                         f"non-empty name without '/', '\\\\' or NUL, and not '.' or '..'")
    if len(identifier.encode("utf-8")) > 255:
        raise ValueError(f"identifier of {len(identifier.encode('utf-8'))} bytes is longer than a folder name "
                         f"may be (255)")
    return identifier


class SharedStorage:
    """Items' rows in vLLM's EC storage layout, within a bound; see the module docstring."""

    def __init__(self, root: str | os.PathLike, max_bytes: int = 0, min_age_s: float = 600.0,
                 clock: Callable[[], float] = time.time, fsync: bool = True) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.min_age_s = min_age_s
        self.clock = clock
        self.fsync = fsync
        self.stats = StorageStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # --- what is there ---------------------------------------------------------------------------

    def path_of(self, identifier: str) -> Path:
        return self.root / check_identifier(identifier) / FILE_NAME

    @property
    def files(self) -> int:
        return len(self._entries)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def _scan(self) -> None:
        """Count the items already stored, oldest first; leftovers of interrupted writes are removed."""
        found = []
        with os.scandir(self.root) as folders:
            for folder in folders:
                if not folder.is_dir(follow_symlinks=False):
                    continue
                for leftover in Path(folder.path).glob(_TEMP_PREFIX + "*"):
                    leftover.unlink(missing_ok=True)
                try:
                    stat = os.stat(os.path.join(folder.path, FILE_NAME))
                except OSError:
                    continue
                found.append((stat.st_mtime, folder.name, stat.st_size))
        for mtime, name, size in sorted(found):
            self._entries[name] = _Entry(size, mtime)
            self._bytes += size
        if found:
            log.info("EC storage %s: %d items, %d bytes already there", self.root, len(found), self._bytes)

    def lookup(self, identifier: str) -> bool:
        """Whether the item is stored (as a consumer's `has_cache_item` sees it); a hit refreshes its place
        and its modification time, so it is evicted last, also after a restart."""
        path = self.path_of(identifier)
        with self._lock:  # never between an eviction's choice and its deletion
            entry = self._entries.pop(identifier, None)
            if entry is not None:
                self._bytes -= entry.size
            try:
                size = path.stat().st_size
            except OSError:
                return False  # not there, or deleted behind our back
            with contextlib.suppress(OSError):
                os.utime(path)
            self._entries[identifier] = _Entry(size, self.clock())
            self._bytes += size
            self.stats.hits += 1
        return True

    def stored_rows(self, identifier: str) -> int | None:
        """The rows of a stored item, from its safetensors header (None when it cannot be read)."""
        try:
            with open(self.path_of(identifier), "rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(min(length, 1 << 20)))
            return int(header[TENSOR_KEY]["shape"][0])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None

    # --- writing ---------------------------------------------------------------------------------

    def write(self, identifier: str, rows: torch.Tensor) -> int:
        """Store `rows` for `identifier` atomically; then evict beyond the bound. Returns the file's size."""
        from safetensors.torch import save

        path = self.path_of(identifier)
        data = save({TENSOR_KEY: rows.detach().to("cpu").contiguous()})
        path.parent.mkdir(exist_ok=True)
        temp = path.parent / f"{_TEMP_PREFIX}{os.getpid()}.{secrets.token_hex(6)}.tmp"
        try:
            with open(temp, "wb") as handle:
                handle.write(data)
                if self.fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
            with self._lock:
                path.parent.mkdir(exist_ok=True)  # an eviction of the same identifier may have removed it
                os.replace(temp, path)
                entry = self._entries.pop(identifier, None)
                self._bytes += len(data) - (entry.size if entry is not None else 0)
                self._entries[identifier] = _Entry(len(data), self.clock())
                self.stats.writes += 1
                self.stats.bytes_written += len(data)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self.evict()
        return len(data)

    def evict(self) -> int:
        """Delete the least recently used items beyond the bound, none younger than `min_age_s`."""
        if not self.max_bytes:
            return 0
        with self._lock:
            horizon = self.clock() - self.min_age_s
            victims: list[str] = []
            for identifier, entry in self._entries.items():
                if self._bytes <= self.max_bytes or entry.used_at > horizon:
                    break  # in order of use: every later one is younger still
                victims.append(identifier)
                self._bytes -= entry.size
            for identifier in victims:
                del self._entries[identifier]
                folder = self.root / identifier
                (folder / FILE_NAME).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when empty (a write of the same item may be under way in it)
            self.stats.evictions += len(victims)
        if victims:
            log.debug("EC storage: evicted %d items, %d bytes held", len(victims), self._bytes)
        return len(victims)


class ECExampleConnector(Connector):
    """The producer side of `ECExampleConnector`: each item's rows written to the shared storage (an item the
    storage holds already is `held`, not encoded again)."""

    name = "ECExampleConnector"

    def __init__(self, storage: SharedStorage, family: str, version: VllmVersion, files: Executor) -> None:
        self.storage = storage
        self.family = family
        self.version = version
        self.files = files  # the threads file I/O runs in

    @classmethod
    def from_config(cls, config: Any, service: Any, settings: Any, version: VllmVersion) -> ECExampleConnector:
        storage = SharedStorage(config.storage_path, settings.ec_storage_bytes, settings.ec_storage_min_age_s)
        log.info("ECExampleConnector: storage %s (bound %s bytes)", storage.root, settings.ec_storage_bytes or "no")
        return cls(storage, service.adapter.info.family, version, service.media_pool)

    def held(self, identifier: str) -> int | None:
        if not self.storage.lookup(identifier):
            return None
        rows = self.storage.stored_rows(identifier)
        return rows if rows is not None else 0

    async def hand_over(self, items: list[ItemRows], params: Any, request_id: str) -> dict[str, Any]:
        written: dict[str, torch.Tensor] = {}
        for item in items:
            if item.rows is not None and item.source != "held":
                written.setdefault(item.identifier, item.rows)
        if written:
            await asyncio.get_running_loop().run_in_executor(self.files, self._write_all, list(written.items()))
        return transfer_params(items, self.family, self.version)

    def _write_all(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for identifier, rows in items:
            self.storage.write(identifier, rows)

    def info(self) -> dict[str, Any]:
        return {"connector": self.name, "role": "ec_producer", "shared_storage_path": str(self.storage.root)}

    def watch(self, metrics: Any) -> None:
        metrics.watch_ec_storage(self.storage)
