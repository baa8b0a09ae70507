"""Parsers of setting values that are checked when the settings are read and used again where they are
applied: `--api-key-exempt-cidrs`' networks, `--register-with`'s registry list, the URL SGLang reaches this
encoder at, and a dotted `module.Class` path (`--sglang-embedding-class`)."""

from __future__ import annotations

import ipaddress
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


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def exempt_networks(text: str | None) -> tuple[Network, ...]:
    """`--api-key-exempt-cidrs`: comma-separated networks (`10.244.0.0/16`, `fd00::/8`, or one address)."""
    networks = []
    for part in (text or "").split(","):
        if part.strip():
            try:
                networks.append(ipaddress.ip_network(part.strip(), strict=False))
            except ValueError:
                raise ValueError(f"--api-key-exempt-cidrs: {part.strip()!r} is not a network; write CIDRs separated "
                                 "by commas, e.g. 10.244.0.0/16,fd00::/8") from None
    return tuple(networks)


def in_networks(address: str, networks: tuple[Network, ...]) -> bool:
    """Whether a client address lies in one of `networks` (an IPv4-mapped IPv6 address counts as IPv4)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:  # not an IP address (a unix socket's peer): never exempt
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == network.version and ip in network for network in networks)


def parse_store_url(url: str) -> str:
    """`--cache-store`: `mooncake://host:port` (or `host:port`) -> `host:port`; ValueError naming the form."""
    address = url[len("mooncake://"):] if url.startswith("mooncake://") else url
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--cache-store {url!r} is not a Mooncake master address: expected mooncake://HOST:PORT "
                         f"(the master's --rpc_port, 50051 by default)")
    return address
