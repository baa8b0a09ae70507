"""The optional transfer libraries (`transport`): whether each is installed, and the extra that installs it.

Neither Mooncake's TransferEngine nor NIXL is a dependency of the server: a server that is not asked
for a transport that needs one starts without it, and one that is asked says which extra to install.
"""

from __future__ import annotations

import importlib.util

#: library -> (the module it is imported as, the pip extra of this package that installs it, the wheel)
LIBRARIES: dict[str, tuple[str, str, str]] = {
    "mooncake": ("mooncake.engine", "mooncake",
                 "mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on a CUDA machine); its binaries load "
                 "the system's libibverbs1, even over TCP (Debian/Ubuntu: apt-get install libibverbs1)"),
    "nixl": ("nixl._api", "nixl", "nixl (its wheels bundle UCX; it runs over TCP and shared memory where there is "
                                  "no RDMA NIC)"),
}


class MissingLibrary(RuntimeError):
    """A transport was asked for and its library is not installed."""


def installed(library: str) -> bool:
    module = LIBRARIES[library][0]
    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None and \
            importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_message(library: str, wanted_by: str) -> str:
    """One line: what needs the library and how to install it."""
    _, extra, wheel = LIBRARIES[library]
    return (f"{wanted_by} needs the {library} library, which is not installed: pip install {wheel}; "
            f"or, in a checkout of encode-server, pip install -e '.[{extra}]'")


def require(library: str, wanted_by: str) -> None:
    """Raise `MissingLibrary` with the install line unless `library` is importable."""
    if not installed(library):
        raise MissingLibrary(missing_message(library, wanted_by))
