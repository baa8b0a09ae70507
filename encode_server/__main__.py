"""The CLI entry: `encode-server` and `python -m encode_server` parse the settings and serve HTTP."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from encode_server.ops.settings import load_settings

log = logging.getLogger("encode_server.startup")


class Interrupted(KeyboardInterrupt):
    """SIGTERM before the server is ready, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(signum)


def interrupt_on_signals() -> None:
    """Before the server is ready, Ctrl-C raises KeyboardInterrupt and SIGTERM `Interrupted` in the main thread,
    whatever the launcher left them at: a process started in the background without job control, as CI runners
    and supervisors start it, inherits SIGINT ignored, and uvicorn takes both signals over once it serves anyway,
    so ignoring Ctrl-C only until then would leave a start that hangs in a download deaf to it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until a signal. Ctrl-C or SIGTERM before the server is ready (while it downloads, loads or warms up
    the model) exits quietly: one line, status 128 + the signal (130, 143), no traceback."""
    if threading.current_thread() is threading.main_thread():  # uvicorn takes both signals over while it serves
        interrupt_on_signals()
    try:
        serve(argv)
    except SystemExit as exc:
        from encode_server.ops.logs import logs_json

        if isinstance(exc.code, str) and logs_json():  # a start-up error: a JSON line too, not a bare one
            log.critical(exc.code)
            sys.exit(1)
        raise
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        log.warning("interrupted (%s) before the server was ready: exiting without serving", name)
        sys.exit(128 + signum)


def serve(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    from encode_server.ops.housekeeping import Housekeeper, limit_arenas, prefer_huge_pages

    prefer_huge_pages()  # before the first large tensor, and inherited by the ranks and workers started later
    limit_arenas(settings.malloc_arena_max)  # before the worker threads make their arenas
    from encode_server.ops.logs import UVICORN_LOG_CONFIG, configure_logging, route_library_logs

    configure_logging(settings.log_level, settings.log_format)
    os.environ["ENCODER_LOG_FORMAT"] = settings.log_format  # the ranks and workers it starts log alike
    from encode_server.http.listen import ListenError, check_free, open_listeners

    try:  # before the model loads (minutes for a large one): a busy port is known at once
        listeners = open_listeners(settings.host, settings.port)
        if settings.grpc_port is not None:  # gRPC binds its own when it starts; checked now all the same
            check_free(settings.host, settings.grpc_port, "--grpc-port")
    except ListenError as exc:
        sys.exit(f"encode-server: {exc}")
    import uvicorn  # imported late so that --help answers fast

    from encode_server.http.app import create_app
    from encode_server.http.draining import DrainingServer
    from encode_server.runtime import StartError, check_libraries, fronts_for, load_encoder

    route_library_logs()  # transformers and the Hub client are imported now: their lines get our format too
    try:  # before the model loads, as a bad value is refused: one line, status 2
        check_libraries(settings)
        fronts_for(settings)  # each front reads its own settings (vLLM's transfer config, its version)
    except StartError as exc:
        sys.stderr.write(f"encode-server: error: {exc}\n")
        sys.exit(2)
    set_cpu_threads(settings, max(settings.tp_size, settings.dp_size))
    try:
        adapter, group = load_encoder(settings)
    except StartError as exc:
        sys.exit(f"encode-server: {exc}")
    app = create_app(settings, adapter, group)
    # proxy_headers off: a client's address is its connection's peer, never an X-Forwarded-For header
    # (--api-key-exempt-cidrs judges it).
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            log_config=UVICORN_LOG_CONFIG,
                            access_log=settings.log_level == "debug", timeout_graceful_shutdown=5,
                            timeout_keep_alive=settings.keep_alive_timeout_s, proxy_headers=False)
    housekeeper = Housekeeper(settings.housekeeping_interval_s, busy=lambda: _pending(app) > 0,
                              on_run=lambda *figures: _record_housekeeping(app, *figures))
    housekeeper.start()
    server = DrainingServer(config, app, settings.drain_timeout_s)
    try:
        server.run(sockets=listeners)
    finally:
        housekeeper.stop()
    if server.forced is not None:
        sys.exit(128 + server.forced)


def _pending(app) -> int:
    service = getattr(app.state, "service", None)
    return service.pending if service is not None else 0


def _record_housekeeping(app, released: int, collect_s: float, trim_s: float) -> None:
    service = getattr(app.state, "service", None)
    if service is not None:
        service.metrics.record_housekeeping(released, collect_s, trim_s)


def set_cpu_threads(settings, ranks: int) -> None:
    """On CPU, torch's intra-op threads get `Settings.cpu_threads_per_rank` (a no-op on GPUs)."""
    import torch

    if settings.device not in ("auto", "cpu") or (settings.device == "auto" and torch.cuda.is_available()):
        return
    torch.set_num_threads(settings.cpu_threads_per_rank(ranks))


if __name__ == "__main__":
    main()
