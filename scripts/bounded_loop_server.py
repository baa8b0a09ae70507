"""An experiment on event-loop lag, not the server's configuration: `encode-server` on an asyncio loop whose
iterations take a bounded amount of new I/O work, to see how much of the HTTP loop's lag in a burst
is the loop being handed thousands of ready connections at once.

uvloop (libuv) and asyncio's default selector hand every ready socket to one loop iteration: after
a burst of 2,000 requests, one iteration accepts or reads them all, and every timer waits for it.
Here epoll returns at most `BOUNDED_LOOP_EVENTS` ready sockets per iteration (the kernel keeps the
rest ready, round-robin, for the next ones) and a listening socket accepts at most
`BOUNDED_LOOP_ACCEPTS` connections per readiness (the others wait in the kernel's backlog), so work
waits in the kernel instead of in the loop. Results and the reasons it is not the default:
docs/BENCHMARKS.md, "Event-loop lag under 2,000 concurrent requests".

    python scripts/loop_lag.py --server-module scripts.bounded_loop_server
    BOUNDED_LOOP_EVENTS=8 BOUNDED_LOOP_ACCEPTS=2 python scripts/loop_lag.py --server-module scripts.bounded_loop_server
"""

from __future__ import annotations

import asyncio
import math
import os
import select
import selectors
import sys
from pathlib import Path

EVENTS_PER_POLL = int(os.environ.get("BOUNDED_LOOP_EVENTS", "4"))
ACCEPTS_PER_READINESS = int(os.environ.get("BOUNDED_LOOP_ACCEPTS", "1"))


class BoundedEpollSelector(selectors.EpollSelector):
    """`selectors.EpollSelector.select`, asking epoll for at most `EVENTS_PER_POLL` ready sockets."""

    def select(self, timeout: float | None = None):
        if timeout is None:
            timeout = -1
        elif timeout <= 0:
            timeout = 0
        else:
            timeout = math.ceil(timeout * 1e3) * 1e-3  # epoll's resolution is 1 ms: wait at least `timeout`
        try:
            polled = self._selector.poll(timeout, EVENTS_PER_POLL)
        except InterruptedError:
            return []
        ready = []
        for fd, event in polled:
            events = 0
            if event & ~select.EPOLLIN:
                events |= selectors.EVENT_WRITE
            if event & ~select.EPOLLOUT:
                events |= selectors.EVENT_READ
            key = self._key_from_fd(fd)
            if key:
                ready.append((key, events & key.events))
        return ready


class BoundedLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop on `BoundedEpollSelector`, accepting a few connections per readiness.
    (asyncio accepts up to the listen backlog per readiness, 2,048 with uvicorn; the backlog given to
    `listen` is unchanged.)"""

    def __init__(self) -> None:
        super().__init__(BoundedEpollSelector())

    def _start_serving(self, protocol_factory, sock, sslcontext=None, server=None, backlog=100, *more):
        super()._start_serving(protocol_factory, sock, sslcontext, server, min(backlog, ACCEPTS_PER_READINESS), *more)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import uvicorn

    from encode_server.__main__ import main as serve

    uvicorn.Config.get_loop_factory = lambda self: BoundedLoop
    serve()


if __name__ == "__main__":
    main()
