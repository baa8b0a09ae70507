"""The HTTP listening sockets, opened before the model loads.

`open_listeners` binds and listens on `--host`/`--port` at the very start, so a busy port (or an
address this machine does not have) stops the server in a second with one line naming the fix,
rather than after minutes of loading; uvicorn is then handed these sockets, so nothing can take the
port in between. Connections that arrive while the model loads wait in the kernel's backlog and are
answered once the server is ready (as with gunicorn's or systemd's pre-opened sockets).
"""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """The address cannot be listened on; the message names the fix."""


def open_listeners(host: str, port: int, backlog: int = 2048, flag: str = "--port") -> list[socket.socket]:
    """Listening TCP sockets for every address `host` resolves to (one for an IP literal; `localhost`
    may give 127.0.0.1 and ::1), as `asyncio`'s `create_server(host, port)` would bind them. `flag`: the
    setting of the port, named in the errors."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot resolve --host {host!r} ({exc.strerror}): give an address or name of this "
                          "machine (--host or ENCODER_HOST), e.g. 127.0.0.1 or 0.0.0.0") from None
    sockets: list[socket.socket] = []
    seen: set[tuple] = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart beside TIME_WAIT connections
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 entry has its own socket
            try:
                sock.bind(address)
                # Listening now, not after the load: a second server's bind fails here at once
                # (bound-but-not-listening sockets with SO_REUSEADDR do not exclude each other on Linux).
                sock.listen(backlog)
            except OSError as exc:
                raise ListenError(_message(exc, host, port, flag)) from None
            if port == 0:  # every address on the one port the kernel picked
                port = sock.getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def check_free(host: str, port: int, flag: str) -> None:
    """Raise `ListenError` now if `port` cannot be listened on (for a server that binds it itself later, as
    gRPC does: a busy port is then known before the model loads)."""
    if port:
        for sock in open_listeners(host, port, 1, flag):
            sock.close()


def _message(exc: OSError, host: str, port: int, flag: str = "--port") -> str:
    where = f"{host}:{port}"
    env = "ENCODER_" + flag.lstrip("-").replace("-", "_").upper()
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} is already in use on {host}: stop what listens there or choose another port "
                f"with {flag} (or {env})")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {where}: {host} is not an address of this machine; set --host "
                "(or ENCODER_HOST) to one of its addresses, or 0.0.0.0 for all")
    if exc.errno == errno.EACCES:
        return (f"cannot listen on {where}: permission denied (ports below 1024 need privileges); choose "
                f"a port above 1023 with {flag} (or {env})")
    return f"cannot listen on {where}: {exc.strerror or exc}; check --host and {flag} (ENCODER_HOST, {env})"
