"""The CLI entry: `encode-server` and `python -m encode_server` parse the settings and serve HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import encode_server
from encode_server.ops.settings import load_settings

log = logging.getLogger("encode_server.startup")

#: Printed on stderr once the server listens; `encode_server.bench.launcher` waits for it.
READY_LINE = "encode-server ready:"


class Interrupted(KeyboardInterrupt):
    """SIGTERM before the server is ready, raised where the main thread is, as Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int, frame) -> None:
    raise Interrupted(signum)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve until a signal. Ctrl-C or SIGTERM before the server is ready (while it downloads, loads or warms up
    the model) exits quietly: one line, status 128 + the signal (130, 143), no traceback."""
    if threading.current_thread() is threading.main_thread():  # uvicorn takes both signals over while it serves
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve(argv)
    except SystemExit as exc:
        from encode_server.ops.logs import logs_json

        if isinstance(exc.code, str) and logs_json():  # a start-up error: a JSON line too, not a bare one
            logging.getLogger("encode_server.startup").critical(exc.code)
            sys.exit(1)
        raise
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        logging.getLogger("encode_server.startup").warning(
            "interrupted (%s) before the server was ready: exiting without serving", signal.Signals(signum).name)
        sys.exit(128 + signum)


def serve(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    from encode_server.ops.housekeeping import Housekeeper, limit_arenas, prefer_huge_pages

    prefer_huge_pages()  # before the first large tensor, and inherited by the ranks and workers started later
    limit_arenas(settings.malloc_arena_max)  # before the worker threads make their arenas
    from encode_server.ops.logs import UVICORN_LOG_CONFIG, configure_logging, route_library_logs

    configure_logging(settings.log_level, settings.log_format)
    os.environ["ENCODER_LOG_FORMAT"] = settings.log_format  # the ranks and workers it starts log alike
    from encode_server.http.listen import ListenError, open_listeners

    try:  # before the model loads (minutes for a large one): a busy port is known at once
        listeners = open_listeners(settings.host, settings.port)
    except ListenError as exc:
        sys.exit(f"encode-server: {exc}")
    import uvicorn  # imported late so that --help answers fast

    from encode_server.http.app import create_app
    from encode_server.models import DTYPE_NAMES, DeviceError, load_adapter, resolve_model
    from encode_server.models.base import resolve_device
    from encode_server.models.registry import ModelNotFound

    route_library_logs()  # transformers and the Hub client are imported now: their lines get our format too
    group = None
    world = max(settings.tp_size, settings.dp_size)
    try:
        device = resolve_device(settings.device, world)
    except DeviceError as exc:
        sys.exit(f"encode-server: {exc}")
    try:  # a Hub id becomes its local encoder-only folder here, downloaded once for every rank
        log.info("resolving model %s", settings.model)
        model = resolve_model(settings.model)
    except ModelNotFound as exc:  # the message names the model and what it should be
        sys.exit(f"encode-server: {exc}")
    except (ValueError, OSError) as exc:
        sys.exit(f"encode-server: cannot load model {settings.model!r}: {exc}")
    set_cpu_threads(settings, world)
    if world > 1:
        from encode_server.parallel.ranks import WorkerGroup

        log.info("starting %d %s ranks", world - 1, "tensor-parallel" if settings.tp_size > 1 else "data-parallel")
        group = WorkerGroup(dataclasses.replace(settings, model=model), "tp" if settings.tp_size > 1 else "dp", world)
        group.start()  # the other ranks load the model while this one does
    try:
        log.info("loading model %s on %s (dtype %s)", settings.model, device, settings.dtype)
        loading = time.monotonic()
        adapter = load_adapter(model, settings.device, settings.dtype,
                               name=settings.model if model != settings.model else None)
        log.info("loaded %s (family %s, %s) in %.1f s", adapter.info.name, adapter.info.family,
                 DTYPE_NAMES[adapter.dtype], time.monotonic() - loading)
        if group is not None and group.role == "tp":
            from encode_server.parallel.ranks import join_tensor_parallel

            adapter = join_tensor_parallel(adapter, group)
    except (ValueError, OSError) as exc:  # CheckpointError and ShardingError are ValueErrors
        if group is not None:
            group.stop()
        from encode_server.models.registry import ModelNotFound

        found = not isinstance(exc, ModelNotFound)  # else the message names the model and what it should be
        sys.exit(f"encode-server: cannot load model {settings.model!r}: {exc}" if found else f"encode-server: {exc}")
    if settings.preprocess_device != "cpu":
        from encode_server.preprocessing.gpu import PreprocessDeviceError, use_device_preprocessing

        try:
            use_device_preprocessing(adapter, settings.preprocess_device)
        except PreprocessDeviceError as exc:
            if group is not None:
                group.stop()
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


class DrainingServer:
    """uvicorn, with a drain first: on SIGTERM or SIGINT the service stops admitting (503, and /health
    503 so load balancers move away), requests in flight finish within the drain timeout, then uvicorn
    shuts down and the process exits 0.

    A second signal (or a first before the service is up) exits at once: what is queued answers 503, the
    batch running gets up to `FORCED_GRACE_S` to finish, the service stops (ranks and workers with it),
    and `run()` returns with `forced` set to the signal (`main` exits 128 + it: 130 for Ctrl-C). uvicorn's
    own handler is never called: it re-raises the signal after serving, a KeyboardInterrupt traceback."""

    FORCED_GRACE_S = 1.0

    def __new__(cls, config, app, drain_timeout_s: float):
        import uvicorn

        class _Server(uvicorn.Server):
            draining = False
            forced: int | None = None

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets=sockets)
                if self.started and self.forced is None:  # serving: tell supervisors at any log level
                    from encode_server.ops.logs import announce

                    port = sockets[0].getsockname()[1] if sockets else config.port
                    host = f"[{config.host}]" if ":" in config.host else config.host
                    announce("encode_server.startup", f"{READY_LINE} http://{host}:{port} (started in "
                                                      f"{time.monotonic() - encode_server.IMPORTED_AT:.1f} s)")

            def handle_exit(self, sig, frame) -> None:
                service = getattr(app.state, "service", None)
                if self.forced is not None:
                    return
                if self.draining or self.should_exit or service is None:
                    self.forced = sig
                    if service is None:
                        logging.getLogger("encode_server").warning(
                            "signal %s before the server was ready: exiting without serving", sig)
                        self.should_exit = self.force_exit = True
                        return
                    logging.getLogger("encode_server").warning(
                        "signal %s again: exiting now (%d requests in flight answer 503)", sig, service.pending)
                    loop = asyncio.get_event_loop()
                    loop.call_soon_threadsafe(lambda: loop.create_task(self._exit_now(service)))
                    return
                self.draining = True
                logging.getLogger("encode_server").info(
                    "signal %s: draining %d requests (up to %g s)", sig, service.pending, drain_timeout_s)
                loop = asyncio.get_event_loop()
                loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(service)))

            async def _drain(self, service) -> None:
                service.begin_drain()
                drained = await service.wait_drained(drain_timeout_s)
                if not drained and self.forced is None:
                    logging.getLogger("encode_server").warning(
                        "drain timeout: %d requests still in flight are failed", service.pending)
                    service.fail_queued("the server shut down before this request's turn")
                    await service.wait_drained(5.0)  # let their handlers answer 503
                self.should_exit = True

            async def _exit_now(self, service) -> None:
                service.give_up("the server is shutting down (a second signal)")
                await service.wait_drained(cls.FORCED_GRACE_S)
                self.should_exit = self.force_exit = True

            async def shutdown(self, sockets=None) -> None:
                await super().shutdown(sockets=sockets)  # forced: no wait for connections, no lifespan
                if self.forced is None:
                    return
                # The service's own stop (scheduler, ranks, workers, shared memory), bounded; then the
                # handlers still running write their 503s before the loop ends.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.lifespan.shutdown(), 3.0)
                if self.server_state.tasks:
                    await asyncio.wait(set(self.server_state.tasks), timeout=cls.FORCED_GRACE_S)

        return _Server(config)


if __name__ == "__main__":
    main()
