"""Start the suite's Python subprocesses from a pre-warmed interpreter: ``run`` and ``Popen`` here
take the arguments of :mod:`subprocess`'s own.

Why: the suite starts about two thousand ``python -m sqla_jobs.cli …`` and ``python -m alembic …``
processes, and on a 2-core machine each cold start spends 0.6 s of CPU importing SQLAlchemy's
ORM and dialects and the database drivers: about half of the whole suite's CPU. A fork server
(one per pytest process, started on first use) imports those third-party packages once and
forks a child per command. The child is a real process (its own pid, signals, exit code, file
descriptors, environment, working directory and ``sys.path``), and it imports sqla-jobs, the
application and the command fresh, so the code under test runs exactly as it does from a shell;
only the import of SQLAlchemy, psycopg and PyMySQL is already done.

What still starts cold (plain :mod:`subprocess`): anything that is not ``python [-u] -m MODULE``,
``python [-u] -c CODE`` or ``python [-u] SCRIPT``, a call with ``preexec_fn`` or ``pass_fds``, and
every test that checks what a fresh interpreter imports or how the package installs (those call
:mod:`subprocess` directly). ``SQLA_JOBS_TEST_COLD=1`` sends every start through :mod:`subprocess`.

The protocol, over a Unix socket per child: the client sends one JSON line (argv, env, cwd, new
session) with the child's stdin, stdout and stderr as ``SCM_RIGHTS`` file descriptors; the server
forks, answers the child's pid, and later its exit code as ``subprocess`` reports it (negative:
killed by that signal).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

#: What the server imports before it forks: third-party packages every command loads, nothing of
#: sqla-jobs, the tests or the optional extras (tests check how the package behaves without them).
WARM = ("sqlalchemy", "sqlalchemy.orm", "sqlalchemy.dialects.postgresql",
        "sqlalchemy.dialects.mysql", "sqlalchemy.dialects.sqlite", "psycopg", "pymysql", "argparse",
        "logging", "json", "asyncio", "concurrent.futures")

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL
_COLD = os.environ.get("SQLA_JOBS_TEST_COLD") == "1"


# --- the server side: runs as ``python tests/forkserver.py SOCKET`` ------------------------------

def _serve(path: str) -> dict[str, Any] | None:
    """Accept requests and fork; returns only in a forked child, with its request."""
    for name in WARM:
        __import__(name)
    # Keep the collector off the warm objects: a child's collections (and its exit) would otherwise write
    # to every one of them, copying each page the fork shares, which costs more than the imports saved.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    parent = os.getppid()
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while os.getppid() == parent:  # the pytest process that started us is gone: so are we
        readable, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 512)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the client went away; nothing waits for this code
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd, target in zip(fds, (0, 1, 2), strict=True):
                os.dup2(fd, target)
            os.closerange(3, os.sysconf("SC_OPEN_MAX") if request["close_fds"] else 3)
            return dict(request)
        for fd in fds:
            os.close(fd)
        # With the pid goes a pidfd, opened while the child cannot have been reaped yet (only this loop reaps
        # it): the client signals through it, so a signal sent after the child's exit fails instead of
        # reaching whatever process the kernel gave the pid to next (pids wrap within minutes in this suite).
        pidfd = os.pidfd_open(pid)
        socket.send_fds(conn, [f"pid {pid}\n".encode()], [pidfd])
        os.close(pidfd)
        children[pid] = conn
    return None


def _become(request: dict[str, Any], base_path: list[str]) -> None:
    """In the forked child: take on the request's process state, then run its command as ``python`` would."""
    import importlib
    import runpy
    import types

    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    if request["unbuffered"] or os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    mode, target, args = request["mode"], request["target"], request["args"]
    first = {"-m": os.getcwd(), "-c": ""}.get(mode, str(Path(target).resolve().parent))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    importlib.invalidate_caches()
    if mode == "-m":
        sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif mode == "-c":
        sys.argv = ["-c", *args]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")


# --- the client side: the tests' processes ------------------------------------------------------

class _Server:
    """This pytest process's fork server, started on first use and stopped at exit."""

    lock = threading.Lock()
    current: _Server | None = None

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="sqla-jobs-forkserver-")
        self.path = os.path.join(self.dir, "socket")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdin=DEVNULL,
                                     stdout=PIPE, cwd=self.dir)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the test fork server did not start (said {ready!r})")
        atexit.register(self.stop)

    @classmethod
    def get(cls) -> _Server:
        with cls.lock:
            if cls.current is None or cls.current.proc.poll() is not None:
                cls.current = cls()
            return cls.current

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def _parse(argv: list[str]) -> tuple[str, str, list[str], bool] | None:
    """``(mode, target, args, unbuffered)`` of a ``python`` command line the server can run, else None."""
    if not argv or argv[0] != sys.executable:
        return None
    rest, unbuffered = list(argv[1:]), False
    if rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if len(rest) >= 2 and rest[0] in ("-m", "-c"):
        return rest[0], rest[1], rest[2:], unbuffered
    if rest and not rest[0].startswith("-"):
        return "script", rest[0], rest[1:], unbuffered
    return None


class Popen:
    """The part of :class:`subprocess.Popen` the tests use, for a child of the fork server."""

    def __init__(self, args: list[str], *, stdin: Any = None, stdout: Any = None, stderr: Any = None,
                 env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 text: bool = False, universal_newlines: bool = False, encoding: str | None = None,
                 errors: str | None = None, start_new_session: bool = False, close_fds: bool = True,
                 **cold: Any) -> None:
        self.args = list(map(str, args))
        self.returncode: int | None = None
        self.stdin: IO[Any] | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self._cold: subprocess.Popen[Any] | None = None
        self._pidfd: int | None = None  # the warm child's, from the server (send_signal)
        parsed = _parse(self.args)
        if _COLD or parsed is None or cold:
            given = {"text": text, "universal_newlines": universal_newlines, "encoding": encoding, "errors": errors}
            self._cold = subprocess.Popen(self.args, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                          start_new_session=start_new_session, close_fds=close_fds,
                                          **{k: v for k, v in given.items() if v}, **cold)
            self.pid = self._cold.pid
            self.stdin, self.stdout, self.stderr = self._cold.stdin, self._cold.stdout, self._cold.stderr
            return
        mode, target, rest, unbuffered = parsed
        as_text = text or universal_newlines or encoding is not None or errors is not None
        ours: list[int] = []  # the parent's ends of pipes, and fds opened here, closed once sent
        child_fds: list[int] = []
        for index, spec in enumerate((stdin, stdout, stderr)):
            if spec is None:
                child_fds.append(index)
            elif spec == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                ours.append(fd)
                child_fds.append(fd)
            elif spec == STDOUT and index == 2:
                child_fds.append(child_fds[1])
            elif spec == PIPE:
                r, w = os.pipe()
                mine, theirs = (w, r) if index == 0 else (r, w)
                ours.append(theirs)
                child_fds.append(theirs)
                stream = os.fdopen(mine, "w" if index == 0 else "r", encoding=encoding, errors=errors) if as_text \
                    else os.fdopen(mine, "wb" if index == 0 else "rb")
                setattr(self, ("stdin", "stdout", "stderr")[index], stream)
            elif isinstance(spec, int):
                child_fds.append(spec)
            else:
                child_fds.append(spec.fileno())
        request = {"mode": mode, "target": target, "args": rest, "unbuffered": unbuffered,
                   "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
                   "new_session": start_new_session, "close_fds": close_fds}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_Server.get().path)
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], child_fds)
        for fd in ours:
            os.close(fd)
        first, fds, _, _ = socket.recv_fds(self._conn, 1, 1)  # the pidfd comes with the line's first byte
        while first and not first.endswith(b"\n"):  # byte by byte: the exit line may follow in the same read
            more = self._conn.recv(1)
            first += more
            if not more:
                break
        line = first.split()
        if not line or line[0] != b"pid" or not fds:
            raise RuntimeError(f"the test fork server did not start {self.args}: {line!r}")
        self.pid = int(line[1])
        self._pidfd = fds[0]
        self._reader = self._conn.makefile("rb")

    def poll(self) -> int | None:
        if self._cold is not None:
            self.returncode = self._cold.poll()
            return self.returncode
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], 0)
            if ready:
                self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._cold is not None:
            self.returncode = self._cold.wait(timeout)
            return self.returncode
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def _read_exit(self) -> None:
        line = self._reader.readline().split()
        if len(line) != 2 or line[0] != b"exit":
            raise RuntimeError(f"the test fork server lost {self.args} (pid {self.pid}): {line!r}")
        self.returncode = int(line[1])
        self._reader.close()
        self._conn.close()
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        if getattr(self, "_pidfd", None) is not None:
            self._close_pidfd()

    def send_signal(self, sig: int) -> None:
        """As :class:`subprocess.Popen`'s: nothing once the child has exited. Never ``os.kill(pid)``: the
        server reaps the child, after which its pid may already be another process's (a database's)."""
        if self._cold is not None:
            self._cold.send_signal(sig)
        elif self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):  # exited and reaped meanwhile
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if self._cold is not None:
            out_err = self._cold.communicate(input, timeout)
            self.returncode = self._cold.returncode
            return out_err
        if self.stdin is not None and not self.stdin.closed:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        deadline = None if timeout is None else time.monotonic() + timeout
        chunks: dict[IO[Any], list[Any]] = {s: [] for s in (self.stdout, self.stderr)
                                             if s is not None and not s.closed}
        open_streams = list(chunks)
        while open_streams:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(open_streams, [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for stream in ready:
                data = os.read(stream.fileno(), 1 << 16)
                if data:
                    chunks[stream].append(data)
                else:
                    open_streams.remove(stream)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        out = [self._decode(stream, b"".join(chunks[stream])) if stream in chunks else None
               for stream in (self.stdout, self.stderr)]
        for stream in chunks:
            stream.close()
        return out[0], out[1]

    @staticmethod
    def _decode(stream: IO[Any], data: bytes) -> Any:
        encoding = getattr(stream, "encoding", None)
        if encoding is None or "b" in getattr(stream, "mode", "b"):
            return data
        return data.decode(encoding, getattr(stream, "errors", None) or "strict").replace("\r\n", "\n")

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cold is not None:
            self._cold.__exit__(*exc)
            self.returncode = self._cold.returncode
            return
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        if self.returncode is None:
            self.wait()


def run(args: list[str], *, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, **kw: Any) -> subprocess.CompletedProcess[Any]:
    """:func:`subprocess.run` through the fork server."""
    if input is not None:
        kw["stdin"] = PIPE
    if capture_output:
        kw["stdout"] = kw["stderr"] = PIPE
    with Popen(args, **kw) as proc:
        try:
            out, err = proc.communicate(input, timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


if __name__ == "__main__":
    # Drop this file's folder from the path the children start from: they get their own first entry.
    _base = [p for p in sys.path[1:]]
    _request = _serve(sys.argv[1])
    if _request is not None:
        _become(_request, _base)
