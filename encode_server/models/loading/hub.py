"""Models by Hugging Face Hub id: `org/name[@revision]` becomes a local encoder-only checkpoint folder.

Everything goes through `huggingface_hub`, so its cache and variables work as users know them
(`HF_HOME`, `HF_HUB_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_ENDPOINT`). On the first use of a commit:

1. the config, processor, tokenizer and chat-template files and the weights' index (`PROCESSOR_FILES`,
   plus the vocabulary files of the tokenizer class `tokenizer_config.json` names) are downloaded into
   the Hub cache with `snapshot_download` (and `hf_hub_download` for those vocabulary files);
2. the family that serves the config chooses the tensors its encoder needs, by its own loader run on
   those files and the checkpoint's list of keys (`checkpoint.encoder_keys_of`; the index lists them,
   or the single `model.safetensors`' header, read by byte range);
3. only those tensors' bytes are read, by HTTP Range requests through `HfFileSystem`
   (`safetensors_ranges.copy_tensors`), into one `model.safetensors` beside copies of the files of 1.

The folder is assembled under a temporary name and renamed into place as
`$HF_HOME/encode-server/<org>--<name>/<commit>/` (`encoder_cache_folder`), so an interrupted download
leaves nothing that looks complete, and a later start (offline too) loads it without the network.
Failures become one-line `CheckpointError`s naming the fix: offline and not cached, no such repository
or revision, a gated or private repository without a token.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from encode_server.models.loading.checkpoint import CheckpointError, encoder_keys_of
from encode_server.models.loading.safetensors_ranges import Header, SafetensorsFormatError, copy_tensors, read_header

log = logging.getLogger(__name__)

WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
#: What `AutoConfig` and `AutoProcessor` (its image, video and audio processors, its tokenizer and chat
#: templates) read from a repository, as `transformers` names them, besides the tokenizer's vocabulary
#: files (added per repository by `vocabulary_files`), and the weights' index.
PROCESSOR_FILES = (
    "config.json",  # CONFIG_NAME
    "generation_config.json",  # GENERATION_CONFIG_NAME
    "processor_config.json",  # PROCESSOR_NAME
    "preprocessor_config.json",  # IMAGE_PROCESSOR_NAME, FEATURE_EXTRACTOR_NAME
    "video_preprocessor_config.json",  # VIDEO_PROCESSOR_NAME
    "audio_tokenizer_config.json",  # AUDIO_TOKENIZER_NAME
    "chat_template.jinja",  # CHAT_TEMPLATE_FILE
    "chat_template.json",  # LEGACY_PROCESSOR_CHAT_TEMPLATE_FILE
    "additional_chat_templates/*.jinja",  # CHAT_TEMPLATE_DIR
    "tokenizer_config.json",  # TOKENIZER_CONFIG_FILE
    "tokenizer.json",  # FULL_TOKENIZER_FILE
    "special_tokens_map.json",  # SPECIAL_TOKENS_MAP_FILE
    "added_tokens.json",  # ADDED_TOKENS_FILE
    "tokenizer.model",  # the sentencepiece model of TokenizersBackend (the default tokenizer class)
    WEIGHTS_INDEX,
)
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[^\s@]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubId:
    """A model repository on the Hub and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(model: str) -> HubId | None:
    """`org/name` or `org/name@revision` as a `HubId`; None for anything else."""
    match = _HUB_ID.fullmatch(model)
    if match is None or ".." in match["repo"] or "--" in match["repo"]:
        return None
    return HubId(match["repo"], match["revision"])


def encoder_cache_folder(repo_id: str, commit: str) -> Path:
    """Where the encoder-only folder of one commit lives: `$HF_HOME/encode-server/<org>--<name>/<commit>`."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "encode-server" / repo_id.replace("/", "--") / commit


def encoder_checkpoint(hub_id: HubId) -> Path:
    """The local encoder-only folder for a Hub model, downloading what the encoder needs on first use."""
    from huggingface_hub import constants

    if hub_id.revision and _COMMIT.fullmatch(hub_id.revision):  # a commit: no need to ask the Hub which one
        ready = encoder_cache_folder(hub_id.repo_id, hub_id.revision)
        if _complete(ready):
            return ready
    with _hub_errors(hub_id):
        snapshot = _download_processor_files(hub_id)
    target = encoder_cache_folder(hub_id.repo_id, snapshot.name)
    if _complete(target):
        log.info("%s: the encoder's checkpoint is cached in %s", hub_id, target)
        return target
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(_offline_message(hub_id))
    with _hub_errors(hub_id):
        return _build(hub_id, snapshot, target)


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / SINGLE_WEIGHTS).is_file()


def _download_processor_files(hub_id: HubId) -> Path:
    """The Hub cache's snapshot folder of the commit, holding (at least) the processor files and the index."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(hub_id.repo_id, revision=hub_id.revision, allow_patterns=list(PROCESSOR_FILES)))


def _download_vocabulary_files(hub_id: HubId, snapshot: Path) -> list[str]:
    """Fetch into the snapshot the vocabulary files of the repository's tokenizer class; their names."""
    from huggingface_hub import errors, hf_hub_download

    names = vocabulary_files(snapshot)
    for name in names:
        # what PROCESSOR_FILES matches, `snapshot_download` has fetched already if the repository has it
        if not (snapshot / name).is_file() and not any(fnmatch(name, pattern) for pattern in PROCESSOR_FILES):
            try:
                hf_hub_download(hub_id.repo_id, name, revision=snapshot.name)
            except errors.EntryNotFoundError:  # the class can do without it (e.g. tokenizer.json is there)
                pass
    return names


def vocabulary_files(snapshot: Path) -> list[str]:
    """The files the tokenizer class named in `tokenizer_config.json` reads (`vocab_files_names`), if any."""
    path = snapshot / "tokenizer_config.json"
    try:
        name = json.loads(path.read_text()).get("tokenizer_class") if path.is_file() else None
    except ValueError:
        return []
    if not isinstance(name, str):
        return []
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        tokenizer_class = tokenizer_class_from_name(name) or tokenizer_class_from_name(name.removesuffix("Fast"))
        names = getattr(tokenizer_class, "vocab_files_names", None) or {}
    except Exception:  # noqa: BLE001 (a class this installation cannot import: the processor will say so)
        return []
    return sorted({value for value in names.values() if isinstance(value, str)})


def _build(hub_id: HubId, snapshot: Path, target: Path) -> Path:
    """Assemble the encoder-only folder under a temporary name, then rename it into place."""
    import torch
    from huggingface_hub import HfFileSystem

    from encode_server.models.registry import load_checkpoint

    patterns = [*PROCESSOR_FILES, *_download_vocabulary_files(hub_id, snapshot)]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex}.partial"
    staging.mkdir()  # with the permissions the umask gives, as the folder it becomes
    fs = HfFileSystem()
    commit = snapshot.name

    @contextmanager
    def open_file(name: str) -> Iterator[Any]:
        with fs.open(f"{hub_id.repo_id}@{commit}/{name}", "rb", cache_type="none") as handle:
            yield handle

    try:
        for path in snapshot.rglob("*"):
            name = path.relative_to(snapshot).as_posix()
            if path.is_file() and name != WEIGHTS_INDEX and any(fnmatch(name, pattern) for pattern in patterns):
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, staging / name)  # the content, not the cache's symlink
        headers: dict[str, Header] = {}
        index = snapshot / WEIGHTS_INDEX
        if index.is_file():
            key_files = _weight_map(index, hub_id)
        else:
            headers[SINGLE_WEIGHTS] = _header(open_file, SINGLE_WEIGHTS, hub_id)
            key_files = dict.fromkeys(headers[SINGLE_WEIGHTS].tensors, SINGLE_WEIGHTS)
        try:
            chosen = encoder_keys_of(staging, key_files,
                                     lambda: load_checkpoint(staging, torch.device("cpu"), torch.float32))
        except CheckpointError as exc:
            message = str(exc).replace(str(staging.resolve()), str(hub_id)).replace(str(staging), str(hub_id))
            raise CheckpointError(message) from None
        sizes: dict[str, int] = {}
        for name in sorted(set(chosen.values())):
            if name not in headers:
                headers[name] = _header(open_file, name, hub_id)
            sizes[name] = fs.size(f"{hub_id.repo_id}@{commit}/{name}")
        read = copy_tensors(open_file, headers, chosen, staging / SINGLE_WEIGHTS, _progress(hub_id, sizes))
        log.info("%s: read the encoder's %d tensors (%s) of %d, from %d weight file(s), into %s", hub_id,
                 len(chosen), _human(read), len(key_files), len(sizes), target)
        try:
            os.rename(staging, target)
        except OSError:
            if not _complete(target):  # another process finished first, or the rename really failed
                raise
            shutil.rmtree(staging, ignore_errors=True)
        return target
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _weight_map(index: Path, hub_id: HubId) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{hub_id}: {WEIGHTS_INDEX} has no valid weight_map ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{hub_id}: {WEIGHTS_INDEX}'s weight_map is not a map of tensor names to files")
    return weight_map


def _header(open_file, name: str, hub_id: HubId) -> Header:
    try:
        with open_file(name) as handle:
            return read_header(handle, name)
    except FileNotFoundError:
        if name != SINGLE_WEIGHTS:
            raise CheckpointError(f"{hub_id}: {name}, named in {WEIGHTS_INDEX}, is not in the repository") from None
        raise CheckpointError(
            f"{hub_id} has no safetensors weights ({SINGLE_WEIGHTS} or {WEIGHTS_INDEX}; .bin weights are not read, "
            f"only safetensors can be read in part): use a revision that has them (--model "
            f"{hub_id.repo_id}@<revision>, such as the refs/pr/N of a pull request converting it to safetensors), "
            f"or convert it once (transformers' from_pretrained, then save_pretrained to a folder, which writes "
            f"safetensors) and pass that folder as --model") from None
    except SafetensorsFormatError as exc:
        raise CheckpointError(f"{hub_id}: {exc}") from None


def _progress(hub_id: HubId, sizes: dict[str, int]):
    """A progress bar per weight file (huggingface_hub's tqdm, so HF_HUB_DISABLE_PROGRESS_BARS applies),
    and a log line when its encoder tensors are read."""
    from huggingface_hub.utils import tqdm

    @contextmanager
    def progress(name: str, total: int) -> Iterator[Any]:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"{hub_id} {name} (encoder tensors)") as bar:
            yield bar
        log.info("%s: %s: read %s of its %s", hub_id, name, _human(total), _human(sizes[name]))

    return progress


def _human(size: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError


def _offline_message(hub_id: HubId) -> str:
    return (f"{hub_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1 is set: run once with network "
            "access, or pass a local folder")


@contextmanager
def _hub_errors(hub_id: HubId) -> Iterator[None]:
    """`huggingface_hub`'s errors as one-line `CheckpointError`s that say what to do."""
    from huggingface_hub import constants, errors

    where = constants.ENDPOINT
    try:
        yield
    except errors.GatedRepoError:
        raise CheckpointError(f"{hub_id} is a gated repository on {where}: accept its terms on its page, then set "
                              "HF_TOKEN to a token of an account that has access") from None
    except errors.RepositoryNotFoundError:
        raise CheckpointError(f"{hub_id}: no local folder of that name, and no model repository {hub_id.repo_id} on "
                              f"{where} (if it is private, set HF_TOKEN to a token with access to it)") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{hub_id}: {hub_id.repo_id} has no revision {hub_id.revision!r} on {where}") from None
    except errors.LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(_offline_message(hub_id)) from None
        cause = exc.__cause__ or exc
        raise CheckpointError(f"{hub_id} is not in the local Hugging Face cache and {where} cannot be reached "
                              f"({type(cause).__name__}): check the network (HF_ENDPOINT, proxies), or pass a "
                              "local folder") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status in (401, 403):
            raise CheckpointError(f"{hub_id}: {where} refused access ({status}): set HF_TOKEN to a token with access "
                                  f"to {hub_id.repo_id}") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{hub_id}: {where} answered {status}: {first}") from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("httpx", "httpx2", "requests"):
            raise
        # a transport error (connection, timeout, proxy) that huggingface_hub let through, e.g. from a range read
        raise CheckpointError(f"{hub_id}: {where} cannot be reached ({type(exc).__name__}: {exc}): check the "
                              "network (HF_ENDPOINT, proxies), or pass a local folder") from None
