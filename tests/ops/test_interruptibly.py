"""`runtime.interruptibly`: a start blocked in a call that never returns (a Hub that accepts and never answers)
still ends at a signal, whichever thread the kernel delivered it to."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest

from encode_server.runtime import interruptibly

pytestmark = pytest.mark.quick


class Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise Stop(signum)


def test_the_value_and_the_error_come_back_as_a_direct_call_gives_them():
    assert interruptibly(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ValueError, match="bad model"):
        interruptibly(lambda: (_ for _ in ()).throw(ValueError("bad model")))


def test_a_signal_delivered_to_another_thread_ends_a_call_blocked_in_a_read_without_timeout():
    """The read never returns and the signal goes to a thread of its own, as the kernel may pick a BLAS pool's
    thread: the handler still runs in the main thread within a wait of 0.1 s."""
    assert threading.current_thread() is threading.main_thread()
    reading, silent = socket.socketpair()
    deliverer = threading.Thread(target=lambda: (time.sleep(0.3), signal.pthread_kill(threading.get_ident(),
                                                                                          signal.SIGUSR1)))
    previous = signal.signal(signal.SIGUSR1, _raise_stop)
    try:
        started = time.monotonic()
        deliverer.start()
        with pytest.raises(Stop):
            interruptibly(reading.recv, 1)  # no data ever comes: blocks until the socket is shut down
        assert time.monotonic() - started < 2.0
    finally:
        signal.signal(signal.SIGUSR1, previous)
        deliverer.join(5)
        reading.shutdown(socket.SHUT_RDWR)  # frees the daemon thread's read
        reading.close()
        silent.close()
