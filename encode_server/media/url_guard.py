"""What media the server may fetch: the address policy, the guarded aiohttp connector, local files.

The policy is judged on the addresses a connection will actually use: `GuardedConnector` filters
what its resolver returns (and IP literals) before any socket is opened, for the first request and
for every redirect hop alike, so a hostname that resolves (or re-resolves) to a private address is
refused. Without `--allow-private-urls`, only globally routable unicast addresses are allowed.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from aiohttp.abc import ResolveResult

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class BlockedAddressError(aiohttp.ClientConnectionError):
    """A URL whose host resolves only to addresses the policy refuses."""


def address_refusal(address: str, allow_private: bool,
                    extra_allowed: Sequence[IPNetwork] = ()) -> str | None:
    """Why `address` may not be fetched from, or None when it may. Pure: no I/O."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in network for network in extra_allowed):
        return None
    if ip.is_unspecified:
        return f"{ip} is an unspecified address"
    if ip.is_multicast:
        return f"{ip} is a multicast address"
    if allow_private and (ip.is_loopback or ip.is_private or ip.is_link_local):
        return None
    for label, flag in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                        ("reserved", ip.is_reserved), ("private", ip.is_private)):
        if flag:
            return f"{ip} is a {label} address"
    if not ip.is_global:
        return f"{ip} is not a public address"
    return None


class GuardedConnector(aiohttp.TCPConnector):
    """A TCP connector that only ever connects to addresses the policy allows."""

    def __init__(self, allow_private: bool, extra_allowed: Sequence[IPNetwork] = (), **kwargs) -> None:
        super().__init__(**kwargs)
        self.allow_private = allow_private
        self.extra_allowed = tuple(extra_allowed)

    async def _resolve_host(self, host: str, port: int, traces=None) -> list[ResolveResult]:  # type: ignore[override]
        results = await super()._resolve_host(host, port, traces=traces)
        allowed, reasons = [], []
        for result in results:
            reason = address_refusal(result["host"], self.allow_private, self.extra_allowed)
            if reason is None:
                allowed.append(result)
            else:
                reasons.append(reason)
        if not allowed:
            raise BlockedAddressError(f"refused to fetch from {host}: {'; '.join(dict.fromkeys(reasons))} "
                                      f"(--allow-private-urls permits private addresses)")
        return allowed


#: Content types that can hold each modality's media (parameters such as charset are ignored).
_CONTENT_TYPES = {
    "image": ("image/",),
    "audio": ("audio/", "application/ogg", "video/ogg"),
    "video": ("video/", "image/"),
}
_NEUTRAL_TYPES = ("application/octet-stream", "binary/octet-stream", "")


def content_type_refusal(content_type: str | None, modality: str) -> str | None:
    """Why a fetched body of this content type cannot be `modality` media, or None."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in _NEUTRAL_TYPES or kind.startswith(_CONTENT_TYPES[modality]):
        return None
    return f"the server sent content type {kind!r}, not {modality} data"


#: How a client sends an item's bytes, for the errors of items that are none of these.
SEND_MEDIA_HOW = ("send the file's bytes as base64 (or a data: URI, data:image/png;base64,...), or an http(s):// "
                  "URL the server can fetch")


def resolve_local_path(raw: str, allowed_dir: str | None) -> Path:
    """The real path of a local media file, only inside `allowed_dir` (symlinks and `..` resolved).

    Raises PermissionError with the reason otherwise.
    """
    if allowed_dir is None:
        raise PermissionError(f"{raw[:200]!r} is a local file path, and local files are not accepted (the server has "
                              f"no --allowed-local-media-dir): {SEND_MEDIA_HOW}, or start the server with "
                              f"--allowed-local-media-dir DIR to read files inside DIR")
    path_text = raw[len("file://"):] if raw.lower().startswith("file://") else raw
    if path_text.startswith("localhost/"):
        path_text = path_text[len("localhost"):]
    if not path_text.startswith("/"):
        raise PermissionError("a local path must be absolute")
    root = Path(allowed_dir).resolve()
    path = Path(os.path.normpath(path_text)).resolve()
    if path != root and root not in path.parents:
        raise PermissionError(f"{raw!r} is outside the allowed media folder (--allowed-local-media-dir)")
    if not path.is_file():
        raise PermissionError(f"{raw!r} is not a readable file in the allowed media folder "
                              f"(--allowed-local-media-dir)")
    return path
