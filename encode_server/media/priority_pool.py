"""A thread pool that runs waiting work highest priority first: media decoding under an offline flood.

The scheduler orders its queue by priority, but a request spends time before it: decoding its items
in the media pool. With a plain `ThreadPoolExecutor` an interactive request's decode waits behind
every queued decode of a flood. `PriorityThreadPool` is a drop-in `Executor` whose waiting work is a
heap keyed by (priority descending, submission order); the priority is read from the context
variable `CURRENT_PRIORITY` at `submit`, so `loop.run_in_executor` (which cannot pass it) works
unchanged: the service sets the variable in the request's task before loading its media.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import threading
from concurrent.futures import Executor, Future

from encode_server.ops.thread_names import name_os_thread

#: The priority of the request whose work is being submitted (set per request task).
CURRENT_PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar("encode_priority", default=0)


class PriorityThreadPool(Executor):
    """`workers` threads taking the highest-priority waiting call first, first come first served within one."""

    def __init__(self, workers: int, thread_name_prefix: str = "priority-pool") -> None:
        self._heap: list[tuple] = []
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{thread_name_prefix}_{index}", daemon=True)
                         for index in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            heapq.heappush(self._heap, (-CURRENT_PRIORITY.get(), next(self._order), future, fn, args, kwargs))
            self._ready.notify()
        return future

    def _work(self) -> None:
        name_os_thread()
        while True:
            with self._ready:
                while not self._heap and not self._closed:
                    self._ready.wait()
                if not self._heap:
                    return
                _, _, future, fn, args, kwargs = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._ready:
            self._closed = True
            if cancel_futures:
                for entry in self._heap:
                    entry[2].cancel()
                self._heap.clear()
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
