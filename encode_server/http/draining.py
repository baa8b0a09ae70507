"""uvicorn's server with a drain first, and a second signal that exits at once.

On SIGTERM or SIGINT the service stops admitting (503, and /health 503 so load balancers move away),
requests in flight finish within the drain timeout, then uvicorn shuts down and the process exits 0.

A second signal (or a first before the service is up) exits at once: what is queued answers 503, the batch
running gets up to `FORCED_GRACE_S` to finish, the service stops (ranks and workers with it), and `run()`
returns with `forced` set to the signal (`__main__` exits 128 + it: 130 for Ctrl-C). uvicorn's own handler is
never called: it re-raises the signal after serving, a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import uvicorn

import encode_server
from encode_server.ops.logs import READY_LINE, announce

log = logging.getLogger("encode_server")


def answered_ok(service) -> int:
    """Requests answered 200 so far (`encoder_requests_total`, every modality)."""
    return int(sum(sample.value for metric in service.metrics.requests_total.collect() for sample in metric.samples
                   if sample.name.endswith("_total") and sample.labels.get("status") == "200"))

class DrainingServer(uvicorn.Server):
    """uvicorn serving `app` (whose `state.service` is set once it runs); see the module docstring."""

    FORCED_GRACE_S = 1.0

    def __init__(self, config: uvicorn.Config, app, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self.forced: int | None = None
        self._cut: tuple[int, int] | None = None  # at a second signal: requests in flight, 200s answered so far

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.forced is None:  # serving: tell supervisors at any log level
            port = sockets[0].getsockname()[1] if sockets else self.config.port
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            announce("encode_server.startup", f"{READY_LINE} http://{host}:{port} (started in "
                                              f"{time.monotonic() - encode_server.IMPORTED_AT:.1f} s)")

    def handle_exit(self, sig, frame) -> None:
        service = getattr(self.app.state, "service", None)
        if self.forced is not None:
            return
        if self.draining or self.should_exit or service is None:
            self.forced = sig
            if service is None:
                log.warning("signal %s before the server was ready: exiting without serving", sig)
                self.should_exit = self.force_exit = True
                return
            # What happens to them is told once it has happened (`shutdown`): the batch running may still finish.
            log.warning("signal %s again: exiting now: %d requests in flight; those queued answer 503, the batch "
                        "running has up to %g s to finish", sig, service.pending, self.FORCED_GRACE_S)
            self._cut = (service.pending, answered_ok(service))
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(lambda: loop.create_task(self._exit_now(service)))
            return
        self.draining = True
        log.info("signal %s: draining %d requests (up to %g s)", sig, service.pending, self.drain_timeout_s)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain(service)))

    async def _drain(self, service) -> None:
        service.begin_drain()
        drained = await service.wait_drained(self.drain_timeout_s)
        if not drained and self.forced is None:
            log.warning("drain timeout: %d requests still in flight are failed", service.pending)
            service.fail_queued("the server shut down before this request's turn")
            await service.wait_drained(5.0)  # let their handlers answer 503
        self.should_exit = True

    async def _exit_now(self, service) -> None:
        service.give_up("the server is shutting down (a second signal)")
        await service.wait_drained(self.FORCED_GRACE_S)
        self.should_exit = self.force_exit = True

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets=sockets)  # forced: no wait for connections, no lifespan
        if self.forced is not None:
            # The service's own stop (scheduler, ranks, workers, shared memory), bounded; then the
            # handlers still running write their 503s before the loop ends.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.lifespan.shutdown(), 3.0)
            if self.server_state.tasks:
                await asyncio.wait(set(self.server_state.tasks), timeout=self.FORCED_GRACE_S)
            service = getattr(self.app.state, "service", None)
            if self._cut is not None and service is not None:
                in_flight, ok_before = self._cut
                finished = min(in_flight, answered_ok(service) - ok_before)
                log.warning("exited on a second signal: of the %d requests in flight then, %d finished (200) and %d "
                            "were cut short (503, or their client had gone)", in_flight, finished, in_flight - finished)
        flush = getattr(self.app, "flush", None)  # the error answers' log: how many lines it left out, if any
        if flush is not None:
            flush()
