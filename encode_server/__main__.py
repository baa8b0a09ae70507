"""The CLI entry: `encode-server` and `python -m encode_server` parse the settings and serve HTTP."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from .settings import load_settings


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn  # imported late so that --help answers fast

    from processors import load_adapter

    from .http_server import create_app

    try:
        adapter = load_adapter(settings.model, settings.device, settings.dtype)
    except (ValueError, OSError) as exc:  # CheckpointError is a ValueError
        sys.exit(f"encode-server: cannot load model {settings.model!r}: {exc}")
    uvicorn.run(
        create_app(settings, adapter),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
