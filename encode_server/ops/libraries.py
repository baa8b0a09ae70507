"""The optional libraries: whether each is installed, and the extra that installs it.

Neither Mooncake's TransferEngine nor NIXL (`transport`) nor gRPC (`--grpc-port`) nor OpenTelemetry's SDK
(`ops.tracing`, `--otlp-traces-endpoint`) is a dependency of the server: a server that is not asked for what
needs one starts without it, and one that is asked says which extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util

#: library -> (the modules it is imported as, space-separated; the pip extra of this package that installs it;
#: what to pip install)
LIBRARIES: dict[str, tuple[str, str, str]] = {
    "mooncake": ("mooncake.engine", "mooncake",
                 "mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on a CUDA machine); its binaries load "
                 "the system's libibverbs1, even over TCP (Debian/Ubuntu: apt-get install libibverbs1)"),
    "nixl": ("nixl._api", "nixl", "nixl (its wheels bundle UCX; it runs over TCP and shared memory where there is "
                                  "no RDMA NIC)"),
    "grpc": ("grpc grpc_health.v1.health_pb2 grpc_reflection.v1alpha.reflection smg_grpc_proto.generated", "grpc",
             "'encode-server[grpc]' (grpcio, grpcio-health-checking, grpcio-reflection and smg-grpc-proto)"),
    "opentelemetry": ("opentelemetry.exporter.otlp.proto.http", "otel",
                      "opentelemetry-sdk opentelemetry-exporter-otlp-proto-http"),
}


class MissingLibrary(RuntimeError):
    """A transport was asked for and its library is not installed, or does not load."""


#: what a library needs from the system, by the shared object its import reports missing
SYSTEM_LIBRARIES: dict[str, str] = {
    "libibverbs.so": "the system's libibverbs1 (Debian/Ubuntu: apt-get install libibverbs1)",
}


def load_problem(library: str) -> str | None:
    """None when `library` imports; else why not, in one line with the remedy.

    A wheel can be installed and still fail to import: Mooncake's binaries load the system's libibverbs
    even over TCP, and `find_spec` alone would call such a library installed."""
    try:
        for module in LIBRARIES[library][0].split():
            if importlib.util.find_spec(module.partition(".")[0]) is None:
                return "not installed"
            importlib.import_module(module)
    except ModuleNotFoundError:
        return "not installed"
    except (ImportError, OSError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        for shared_object, remedy in SYSTEM_LIBRARIES.items():
            if shared_object in reason:
                return f"installed but does not load ({reason}): it needs {remedy}"
        return f"installed but does not load ({reason})"
    return None


def installed(library: str) -> bool:
    """True when `library` is installed and imports."""
    return load_problem(library) is None


def missing_message(library: str, wanted_by: str) -> str:
    """One line: what needs the library, why it cannot be used, and how to install it."""
    _, extra, wheel = LIBRARIES[library]
    problem = load_problem(library)
    if problem is not None and problem != "not installed":
        return f"{wanted_by} needs the {library} library, which is {problem}"
    return (f"{wanted_by} needs the {library} library, which is not installed: pip install {wheel}; "
            f"or, in a checkout of encode-server, pip install -e '.[{extra}]'")


def require(library: str, wanted_by: str) -> None:
    """Raise `MissingLibrary` with the install line unless `library` is importable."""
    if not installed(library):
        raise MissingLibrary(missing_message(library, wanted_by))
