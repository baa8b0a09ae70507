"""Ctrl-C and SIGTERM end a start that is not ready yet: the handlers `__main__` installs whatever the launcher
left the signals at, and `runtime.interruptibly`, which keeps a start blocked in a call that never returns (a Hub
that accepts and never answers) within reach of a signal, whichever thread the kernel delivered it to."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest

from encode_server.__main__ import Interrupted, interrupt_on_signals
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


def test_a_start_launched_with_sigint_ignored_still_answers_ctrl_c():
    """A background job without job control (a CI runner, a supervisor) inherits SIGINT ignored; before the server
    is ready Ctrl-C must still raise in the main thread, as SIGTERM does."""
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    try:
        interrupt_on_signals()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        with pytest.raises(Interrupted) as raised:
            signal.raise_signal(signal.SIGTERM)
        assert raised.value.signum == signal.SIGTERM
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
