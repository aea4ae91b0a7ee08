"""A private, throwaway PostgreSQL server for tests that restart the server.

The shared server must never be restarted, so the restart test runs its own:
``initdb`` into a temporary directory as the ``postgres`` OS user (PostgreSQL
refuses to run as root), on a free port, trust auth, fsync off. Binaries come
from ``/usr/lib/postgresql/*/bin`` or ``PATH``. ``unavailable()`` says why
this machine cannot do it (then the test skips locally and fails in CI).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _bindir() -> Path | None:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def unavailable() -> str | None:
    """Why a private cluster cannot be started here, or None."""
    if _bindir() is None:
        return "no initdb found under /usr/lib/postgresql/*/bin or on PATH"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root but there is no 'postgres' OS user to run the server as"
        if shutil.which("runuser") is None:
            return "running as root without runuser to drop to the 'postgres' user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateCluster:
    def __init__(self) -> None:
        bindir = _bindir()
        assert bindir is not None
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="sqla-jobs-pg-"))
        self.data = self.dir / "data"
        self.port = _free_port()
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bindir / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120, cwd=self.dir)

    def start(self) -> None:
        # fsync off is safe for tests that stop the server, never the machine: written WAL stays in the
        # OS cache. synchronous_commit must stay on: off, an immediate stop (a crash) forgets commits it
        # already acknowledged, and a job a worker was told it finished comes back running.
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
                   "-c fsync=off -c synchronous_commit=on -c full_page_writes=off -c max_connections=60")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
