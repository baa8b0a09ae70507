"""Parsers of setting values that are checked when the settings are read and used again where they are
applied: `--register-with`'s registry list, the URL SGLang reaches this encoder at, and a dotted
`module.Class` path (`--sglang-embedding-class`)."""

from __future__ import annotations

import re


def advertised_url(host: str, port: int, explicit: str | None) -> str:
    """The URL SGLang should reach this encoder at: `--advertise-url`, else http://host:port."""
    if explicit:
        return explicit.rstrip("/")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        raise ValueError("--register-with needs --advertise-url when --host is a wildcard address")
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"http://{host}:{port}"


def registry_urls(text: str | None) -> list[str]:
    """`--register-with`'s comma-separated registry URLs (http:// or https://)."""
    urls = [url.strip().rstrip("/") for url in (text or "").split(",") if url.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--register-with: {url!r} is not an http(s):// URL")
    return urls


_CLASS_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


def check_class_path(path: str) -> str:
    """A dotted `module.Class` path; ValueError otherwise."""
    if not isinstance(path, str) or not _CLASS_PATH.match(path):
        raise ValueError(f"{path!r} is not a dotted module.Class path (such as "
                         f"sglang.srt.disaggregation.encoder.receiver.EmbeddingData)")
    return path
