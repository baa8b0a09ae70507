"""A stand-in of the Hugging Face Hub's file API on loopback, serving repositories from local folders.

It answers the calls `huggingface_hub` makes to fetch a model (read from its code:
`HfApi.repo_info`/`model_info`, `list_repo_tree`, `get_paths_info`, and file resolution as
`hf_hub_download` and `HfFileSystem` do it), with the headers they check (`X-Repo-Commit`, `ETag`,
`Content-Length`, `X-Error-Code`), honours HTTP Range requests with 206 answers, and counts every
request and the bytes of file content it serves, per file. Point `HF_ENDPOINT` at `url`.

Routes:
- `GET /api/models/{org}/{name}/revision/{rev}`: the repository's info (`sha`, `siblings`);
- `GET /api/models/{org}/{name}/tree/{rev}[/{path}]`: the files (recursive or not), without pagination;
- `POST /api/models/{org}/{name}/paths-info/{rev}`: the entries for the form's `paths`;
- `HEAD|GET /{org}/{name}/resolve/{rev}/{path}`: a file, whole or a byte range.

A revision is `main` or the repository's commit (the SHA-1 of its id); an unknown repository answers
404 `RepoNotFound`, an unknown revision 404 `RevisionNotFound`, a missing file 404 `EntryNotFound`.
A gated repository (`gated={repo: token}`) lists its files but answers 401 `GatedRepo` to file
requests that do not carry `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

_API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree|paths-info)/(?P<rev>[^/]+)"
                  r"(?:/(?P<path>.*))?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


class HubStandIn:
    """Serves `repos` (repo id -> folder) on 127.0.0.1; `served[(repo, path)]` counts content bytes sent."""

    def __init__(self, repos: dict[str, Path], gated: dict[str, str] | None = None) -> None:
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.gated = dict(gated or {})
        self.served: Counter[tuple[str, str]] = Counter()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repos: dict[str, Path], gated: dict[str, str] | None = None) -> HubStandIn:
        """Serve these repositories too (a running stand-in shared by several tests: each adds its own ids; an id
        already served from another folder is refused, since a shared cache would mix them up)."""
        for repo, folder in repos.items():
            assert self.repos.setdefault(repo, Path(folder)) == Path(folder), f"{repo} is served from another folder"
        self.gated.update(gated or {})
        return self

    def reset_counts(self) -> None:
        with self._lock:
            self.served.clear()
            self.requests.clear()

    def files(self, repo: str) -> dict[str, Path]:
        folder = self.repos[repo]
        return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}

    def __enter__(self) -> HubStandIn:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                stand_in._answer(self, "GET")

            def do_HEAD(self) -> None:
                stand_in._answer(self, "HEAD")

            def do_POST(self) -> None:
                stand_in._answer(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hub-stand-in", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # --- answers ---------------------------------------------------------------------------------

    def _answer(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(handler.path)
        path = unquote(url.path)
        body = b""
        if method == "POST":
            body = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        with self._lock:
            self.requests.append((method, path, handler.headers.get("Range")))
        if (match := _API.fullmatch(path)) is not None:
            self._api(handler, method, match, parse_qs(url.query), body)
        elif (match := _RESOLVE.fullmatch(path)) is not None and method in ("GET", "HEAD"):
            self._resolve(handler, method, match)
        else:
            self._send(handler, 404, b'{"error":"not served by the stand-in"}', method=method)

    def _check(self, handler: BaseHTTPRequestHandler, method: str, repo: str, rev: str) -> bool:
        """False (answered) for an unknown repository or revision."""
        if repo not in self.repos:
            self._send(handler, 404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, method)
            return False
        if rev not in ("main", commit_of(repo)):
            self._send(handler, 404, b'{"error":"Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, method)
            return False
        return True

    def _entry(self, repo: str, name: str, file: Path) -> dict:
        data = file.read_bytes()
        entry = {"type": "file", "path": name, "size": len(data),
                 "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if name.endswith(".safetensors"):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def _api(self, handler, method: str, match: re.Match, query: dict, body: bytes) -> None:
        repo, kind, rev = match["repo"], match["kind"], match["rev"]
        if not self._check(handler, method, repo, rev):
            return
        files = self.files(repo)
        if kind == "revision":
            info = {"id": repo, "modelId": repo, "sha": commit_of(repo), "private": False,
                    "gated": "manual" if repo in self.gated else False,
                    "siblings": [{"rfilename": name} for name in files]}
            self._send_json(handler, info, method)
        elif kind == "tree":
            prefix = (match["path"] or "").strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            entries, folders = [], set()
            for name, file in files.items():
                if prefix and not name.startswith(prefix + "/"):
                    continue
                rest = name[len(prefix) + 1:] if prefix else name
                if "/" in rest and not recursive:
                    folders.add((f"{prefix}/" if prefix else "") + rest.split("/")[0])
                    continue
                entries.append(self._entry(repo, name, file))
            entries += [{"type": "directory", "path": folder, "oid": "0" * 40} for folder in sorted(folders)]
            self._send_json(handler, entries, method)
        else:  # paths-info
            wanted = parse_qs(body.decode()).get("paths", [])
            self._send_json(handler, [self._entry(repo, name, files[name]) for name in wanted if name in files], method)

    def _resolve(self, handler, method: str, match: re.Match) -> None:
        repo, rev, name = match["repo"], match["rev"], match["path"]
        if not self._check(handler, method, repo, rev):
            return
        token = self.gated.get(repo)
        if token is not None and handler.headers.get("Authorization") != f"Bearer {token}":
            self._send(handler, 401, b'{"error":"Access to this model is restricted"}', {"X-Error-Code": "GatedRepo"},
                       method)
            return
        file = self.files(repo).get(name)
        headers = {"X-Repo-Commit": commit_of(repo)}
        if file is None:
            self._send(handler, 404, b'{"error":"Entry not found"}', {**headers, "X-Error-Code": "EntryNotFound"},
                       method)
            return
        data = file.read_bytes()
        headers |= {"ETag": f'"{self._entry(repo, name, file)["oid"]}"', "Accept-Ranges": "bytes"}
        status, start, end = 200, 0, len(data)
        wanted = handler.headers.get("Range")
        if wanted and (found := _RANGE.fullmatch(wanted.strip())) is not None:
            start = int(found[1])
            end = min(int(found[2]) + 1, len(data)) if found[2] else len(data)
            if start >= len(data) or start >= end:
                self._send(handler, 416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"}, method)
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        self._send(handler, status, data[start:end], headers, method)
        if method == "GET":
            with self._lock:
                self.served[(repo, name)] += end - start

    @staticmethod
    def _send(handler, status: int, body: bytes, headers: dict | None = None, method: str = "GET") -> None:
        handler.send_response(status)
        for key, value in (headers or {}).items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(body)

    def _send_json(self, handler, value, method: str) -> None:
        self._send(handler, 200, json.dumps(value).encode(), {"Content-Type": "application/json"}, method)


def hub_env(hub: HubStandIn, home: Path, **extra: str) -> dict[str, str]:
    """The variables `huggingface_hub` reads, pointing at the stand-in and a private cache."""
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_ENDPOINT": hub.url, "HF_TOKEN": "",
            "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", **extra}


def header_of(path: Path) -> tuple[int, dict]:
    """(bytes of the length and the JSON header, the tensors' entries) of a safetensors file."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def weight_files(folder: Path) -> dict[str, list[str]]:
    """Weight file name -> the tensors it holds."""
    files: dict[str, list[str]] = {}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        for key, name in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(name, []).append(key)
    else:
        files["model.safetensors"] = list(header_of(folder / "model.safetensors")[1])
    return files


def expected_bytes(folder: Path, encoder_keys: set[str]) -> dict[str, int]:
    """Per weight file: its header plus the bytes of the encoder tensors it holds (0 if it holds none)."""
    expected = {}
    for name, keys in weight_files(folder).items():
        head, header = header_of(folder / name)
        mine = [key for key in keys if key in encoder_keys]
        expected[name] = head + sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in mine) \
            if mine else 0
    return expected
