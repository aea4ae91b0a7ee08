"""PgBouncer in transaction pooling mode in front of the test server, started by the tests themselves.

Debian's package (``apt-get install pgbouncer``; ``.ci/run`` installs it), on a free port, with a small
server pool handed out round robin (``server_round_robin``), so a client's consecutive transactions run on
different server connections, as they do under load in production. Clients connect with
``?prepare_threshold=none`` (see tests/test_pgbouncer.py) and without LISTEN, which transaction mode lacks.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from tests import forkserver
from tests.conftest import IN_CI, PG_URL, require_postgres

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_pgbouncer(server: str = PG_URL) -> Iterator[tuple[str, str]]:
    """(URL through PgBouncer, direct URL) of a fresh database on ``server`` (the shared test server unless a
    test brings its own); PgBouncer in transaction mode in front."""
    if server == PG_URL:
        require_postgres()
    if not os.path.exists(PGBOUNCER):
        if IN_CI:
            pytest.fail("pgbouncer is not installed: .ci/run installs it (apt-get install -y pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    base = make_url(server)
    name = f"sqla_jobs_pgb_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)  # the server may restart meanwhile
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    # PgBouncer refuses to run as root: it runs as postgres, which cannot enter pytest's private tmp_path.
    folder = Path(tempfile.mkdtemp(prefix="sqla-jobs-pgbouncer-"))
    folder.chmod(0o777)  # its log and pid file go here
    port = free_port()
    (folder / "userlist.txt").write_text(f'"{base.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(f"""\
[databases]
jobs = host={base.host} port={base.port or 5432} dbname={name} user={base.username}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / 'userlist.txt'}
pool_mode = transaction
default_pool_size = 4
server_round_robin = 1
max_client_conn = 200
logfile = {folder / 'pgbouncer.log'}
pidfile = {folder / 'pgbouncer.pid'}
""")
    command = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    process = forkserver.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = (folder / "pgbouncer.log").read_text() if (folder / "pgbouncer.log").exists() else ""
                    raise RuntimeError(f"pgbouncer did not start: {process.stdout.read() if process.stdout else ''}"
                                       f"{log}") from None
                time.sleep(0.1)
        through = base.set(port=port, database="jobs").render_as_string(hide_password=False)
        direct = base.set(database=name).render_as_string(hide_password=False)
        yield through, direct
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
