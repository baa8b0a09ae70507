"""encode-server: a multimodal encoder microservice that batches media across requests."""

import time as _time
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("encode-server")  # the installed package's own version (pyproject.toml)
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

#: When the package was first imported (time.monotonic()): start-up times are measured from it.
IMPORTED_AT = _time.monotonic()
