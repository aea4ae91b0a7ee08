"""A private, throwaway MariaDB server for the matrix cells that stop the server (tests/reliability/test_matrix.py).

The shared server must never be stopped, so those cells run their own, as tests/reliability/cluster.py does for
PostgreSQL: ``mariadb-install-db`` into a temporary directory, ``mariadbd`` on a free port on 127.0.0.1, root
without a password. ``stop("fast")`` is a clean shutdown (SIGTERM), ``stop("immediate")`` a crash (SIGKILL): InnoDB
recovers on the next start, and commits survive because the log is written at every commit
(``innodb_flush_log_at_trx_commit=1``, the default; only the fsync to disk is skipped, a process crash never needs it).
``unavailable()`` says why this machine cannot (the cells then skip locally and fail in CI).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.pgbouncer import free_port

MARIADBD = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
INSTALL_DB = shutil.which("mariadb-install-db") or "/usr/bin/mariadb-install-db"


def unavailable() -> str | None:
    """Why a private MariaDB cannot be started here, or None."""
    for binary in (MARIADBD, INSTALL_DB):
        if not os.path.exists(binary):
            return f"{binary} is missing (apt-get install mariadb-server)"
    return None


class PrivateMariaDB:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sqla-jobs-mariadb-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        # A folder of its own for temporary tables: a starting server deletes every `#sql*` file in its tmpdir as
        # left over from its last run, and in the shared /tmp those are the machine's MariaDB's live temporary
        # tables (a concurrent test then failed with "Error on delete of '/tmp/#sql-temptable-...'").
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        subprocess.run([INSTALL_DB, "--no-defaults", f"--datadir={self.data}", f"--tmpdir={self.tmp}", "--user=root",
                        "--skip-test-db", "--auth-root-authentication-method=normal"],
                       check=True, capture_output=True, timeout=120)
        self.start()

    @property
    def url(self) -> str:
        return f"mariadb+pymysql://root@127.0.0.1:{self.port}/mysql?charset=utf8mb4"

    def start(self) -> None:
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the server's for its lifetime
        self.process = subprocess.Popen(
            [MARIADBD, "--no-defaults", f"--datadir={self.data}", f"--tmpdir={self.tmp}", f"--port={self.port}",
             "--bind-address=127.0.0.1",
             f"--socket={self.dir / 'sock'}", "--user=root", f"--pid-file={self.dir / 'pid'}", "--skip-name-resolve",
             "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=16M", "--innodb-flush-method=nosync",
             "--max-connections=200", "--skip-log-bin"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mariadbd did not start: "
                                       + (self.dir / "server.log").read_text()[-2000:]) from None
                time.sleep(0.05)

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown; ``immediate``: killed, as a crash would."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL if mode == "immediate" else signal.SIGTERM)
        self.process.wait(60)

    def destroy(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
