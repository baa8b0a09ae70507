"""`python -m MODULE` processes for the tests (servers, ranks, failing starts) in a fraction of a second: forked
from one process per test worker (a zygote) that has imported torch, transformers, the package and its
families once, instead of a new interpreter importing them again (5-7 s of CPU each on a 2-core machine; a
forked server is ready in under 1 s).

The child is a real process running the real entry point (`runpy.run_module(MODULE)`, as `python -m` does; for
a MODULE that is a `.py` path, `runpy.run_path` with the script's folder first on `sys.path`, as `python SCRIPT`)
with its own arguments, variables, working folder and output: signals, draining, exit codes, logs,
preprocessing workers and ranks behave as in a new interpreter. The zygote takes only starts whose environment
differs from its own in `FORKED_VARIABLES` alone (the server's `ENCODER_*`, which it reads as it parses its
settings, and a few that nothing reads before the child runs): what a library may read as it is imported
(`PYTHONPATH`, `HF_*`, thread counts) is the zygote's own environment, so a start with other such variables
goes to a zygote started with them (`Zygote.for_environment`). `ZYGOTE=0` starts new interpreters instead.

Wire: the client connects a `SOCK_SEQPACKET` Unix socket per process and sends one message (JSON: module,
arguments, the variables it sets, working folder) with the write ends of the pipes for its stdout and stderr;
the zygote forks, answers `pid N`, and, once it has reaped the child, `exit CODE` (`Popen.returncode`'s
convention). The zygote exits, killing its children, when its standard input (a pipe from the test worker)
closes.

Run as `python -m tests.support.zygote SOCKET_PATH`.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from tests.support.paths import ROOT

READY = b"zygote ready\n"
#: The variables a forked process may have differently from the zygote's environment: the server's own (it reads
#: them as it parses its settings), pytest's bookkeeping (which test is running; nothing reads it at import) and
#: two read only when what reads them first runs, which it never does in the zygote: torch's huge-page switch (at
#: its first large allocation; the server sets it as it starts, and so does a test of that step) and Intel
#: OpenMP's fork setting (when that runtime starts; joblib sets it as a test imports it).
FORKED_VARIABLES = ("ENCODER_", "PYTEST_", "THP_MEM_ALLOC_ENABLE", "KMP_INIT_AT_FORK")


# --- the zygote -----------------------------------------------------------------------------------------

def preload() -> None:
    """Import what every server imports (the families' modules too), without running any torch operation:
    the zygote must have no thread of Python's own and no torch thread pool for its forks to be sound (the
    idle OpenBLAS pools numpy and scipy start as they load shut down around a fork by themselves)."""
    import torch._dynamo  # noqa: F401  (transformers' modeling and the packed attention import it)
    import torch.distributed  # noqa: F401
    import transformers.image_processing_utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    import transformers.processing_utils  # noqa: F401
    import uvicorn  # noqa: F401

    import encode_server.__main__  # noqa: F401
    import encode_server.http.app  # noqa: F401
    import encode_server.http.draining  # noqa: F401
    from encode_server.models.registry import families

    families()
    assert threading.active_count() == 1, f"the zygote must not run threads, it runs {threading.enumerate()}"


def serve(socket_path: str) -> None:
    preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.data == "parent" and not os.read(sys.stdin.fileno(), 4096):  # the test worker is gone
                for pid in children:
                    _kill(pid)
                return
            if key.data == "accept":
                connection, _ = listener.accept()
                _fork(connection, listener, children)
        _reap(children)


def _fork(connection: socket.socket, listener: socket.socket, children: dict[int, socket.socket]) -> None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
    request = json.loads(message)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            listener.close()
            for other in children.values():
                other.close()
            connection.close()
            code = _run_module(request, *fds)
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    children[pid] = connection
    connection.send(f"pid {pid}".encode())


def _run_module(request: dict, stdout_fd: int, stderr_fd: int) -> int:
    """In the child: become `python -m MODULE ARGS` with this output, working folder and these variables."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {stdin, stdout_fd, stderr_fd}:
        os.close(fd)
    for name in [name for name in os.environ if name.startswith(FORKED_VARIABLES)]:
        del os.environ[name]
    os.environ.update(request["forked_env"])
    os.chdir(request["cwd"])
    import encode_server

    encode_server.IMPORTED_AT = time.monotonic()  # "started in" counts from this process's start, as it would
    module = request["module"]
    sys.argv = [module, *request["args"]]
    if module.endswith(".py"):  # a script, as `python SCRIPT` runs it: its folder first on sys.path
        sys.path[0] = os.path.dirname(os.path.abspath(module))
    for name in (module, f"{module}.__main__"):  # run afresh as __main__ (as `python -m` runs it), not reused
        if name in sys.modules and not hasattr(sys.modules[name], "__path__"):
            del sys.modules[name]
    try:
        if module.endswith(".py"):
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter does: a message goes to stderr with status 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # as the interpreter does at exit: wait for non-daemon threads,
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # then run the exit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
            except OSError:  # the client is gone
                pass
            connection.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --- the client (in the test worker) ----------------------------------------------------------------------

class ForkedProcess:
    """The parts of `subprocess.Popen` (text mode) the launcher and the tests use, for a process the zygote
    forked."""

    def __init__(self, connection: socket.socket, pid: int, args: list[str], stdout_fd: int,
                 stderr_fd: int | None) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdout = open(stdout_fd, encoding="utf-8", errors="replace")
        self.stderr = None if stderr_fd is None else open(stderr_fd, encoding="utf-8", errors="replace")
        self._connection = connection

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Read its output to the end and wait for it, within `timeout` in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outputs: dict[str, str] = {}
        streams = [(name, stream) for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
                   if stream is not None]
        readers = [threading.Thread(target=lambda n=name, s=stream: outputs.__setitem__(n, s.read()), daemon=True)
                   for name, stream in streams]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return outputs["stdout"], outputs.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_exit(self) -> None:
        message = self._connection.recv(64).decode()
        self._connection.close()
        if not message.startswith("exit "):  # the zygote died: its children died with it
            self.returncode = -signal.SIGKILL
            return
        self.returncode = int(message.split()[1])


class Zygote:
    """A zygote for one environment (apart from `FORKED_VARIABLES`), started on first use; the test worker keeps
    the last `KEPT` it used and those whose processes still run, and stops the others (all of them as it
    exits: a zygote's processes die with it)."""

    KEPT = 3
    _lock = threading.Lock()
    _running: dict[frozenset, Zygote] = {}  # by environment, the last used last

    def __init__(self, environment: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="encode-zygote-")
        self.socket_path = os.path.join(self.folder, "socket")
        self.environment = environment
        self.children: list[ForkedProcess] = []
        self.process = subprocess.Popen([sys.executable, "-m", "tests.support.zygote", self.socket_path], cwd=ROOT,
                                        env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.process.stdout.readline()
        if line != READY:
            self.process.kill()
            raise RuntimeError(f"the test zygote did not start (it said {line!r})")
        atexit.register(self.stop)

    @classmethod
    def for_environment(cls, environment: dict[str, str]) -> Zygote | None:
        """The zygote that forks processes with this environment (None when `ZYGOTE=0`)."""
        if os.environ.get("ZYGOTE", "1") == "0":
            return None
        key = frozenset(cls.imported_part(environment).items())
        with cls._lock:
            zygote = cls._running.pop(key, None)
            if zygote is None or zygote.process.poll() is not None:
                zygote = cls(cls.imported_part(environment))
            cls._running[key] = zygote
            idle = [key for key, kept in cls._running.items() if not kept.busy()][:-1]  # never the one just used
            for key in idle[:max(0, len(cls._running) - cls.KEPT)]:
                cls._running.pop(key).stop()
            return zygote

    def busy(self) -> bool:
        """Whether a process it forked still runs."""
        self.children = [child for child in self.children if child.poll() is None]
        return bool(self.children)

    @staticmethod
    def imported_part(environment: dict[str, str]) -> dict[str, str]:
        """The variables a process may read as it imports (all but `FORKED_VARIABLES`): a zygote's own."""
        return {name: value for name, value in environment.items() if not name.startswith(FORKED_VARIABLES)}

    def start(self, module: str, args: list[str], environment: dict[str, str], cwd: Path = ROOT,
              stderr_to_stdout: bool = True) -> ForkedProcess:
        """`python -m module *args`, forked; its stdout and stderr (together, or apart) on pipes."""
        pipes = [os.pipe()] if stderr_to_stdout else [os.pipe(), os.pipe()]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(self.socket_path)
            request = {"module": module, "args": args, "cwd": str(cwd),
                       "forked_env": {k: v for k, v in environment.items() if k.startswith(FORKED_VARIABLES)}}
            socket.send_fds(connection, [json.dumps(request).encode()], [pipes[0][1], pipes[-1][1]])
            answer = connection.recv(64).decode()
        except OSError:
            answer = ""
        finally:
            for _, write_fd in pipes:
                os.close(write_fd)
        if not answer.startswith("pid "):
            connection.close()
            for read_fd, _ in pipes:
                os.close(read_fd)
            raise RuntimeError(f"the test zygote did not fork {module} (it said {answer!r})")
        child = ForkedProcess(connection, int(answer.split()[1]), [module, *args], pipes[0][0],
                              None if stderr_to_stdout else pipes[1][0])
        self.children.append(child)
        return child

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # it kills its children and exits
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        for path in (self.socket_path, self.folder):
            try:
                os.unlink(path) if path == self.socket_path else os.rmdir(path)
            except OSError:
                pass


if __name__ == "__main__":
    serve(sys.argv[1])
