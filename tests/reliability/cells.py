"""Where a matrix cell runs (tests/reliability/test_matrix.py): its database, its worker processes, and the hooks
its faults strike through.

A :class:`Target` is one configuration made ready for one scenario. The shared servers serve every scenario but
those that stop the server (``restart``, ``outage``): those get a database on a private server the cell may stop,
a PostgreSQL cluster (tests/reliability/cluster.py, PgBouncer then in front of it) or a MariaDB
(tests/reliability/mariadb_server.py). On SQLite the outage is the write lock held by another process, as a backup
or a long migration would hold it. A :class:`Fleet` is the cell's worker processes.
"""

from __future__ import annotations

import random
import signal
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.pool import NullPool

from tests import app
from tests.conftest import make_database
from tests.pgbouncer import running_pgbouncer

from .conftest import Workers
from .harness import FAST, WorkerProc, kill_tcp_connections, terminate_backends, wait_for
from .matrix import read_spans


class Server(Protocol):
    """A private server a cell may stop: tests/reliability/cluster.py's or mariadb_server.py's."""

    url: str

    def stop(self, mode: str = ...) -> None: ...

    def start(self) -> None: ...


@dataclass
class Target:
    """Where a cell's workers run: their URL and options, an engine for the test's own reads, how to cut every
    connection of given worker processes, and how to take the database away for some seconds (None where a
    configuration has no such thing)."""

    configuration: str
    url: str
    engine: Engine
    options: dict[str, object] = field(default_factory=dict)
    cut: Callable[[list[int]], int] | None = None
    down: Callable[[str, float], None] | None = None


def _pg_cut(engine: Engine) -> Callable[[list[int]], int]:
    return lambda pids: sum(terminate_backends(engine, pid) for pid in pids)


def _mariadb_cut(schema: str) -> Callable[[list[int]], int]:
    return lambda pids: kill_tcp_connections(schema)  # the cell's own database: only its workers use it


def _bouncer_cut(direct: str) -> Callable[[list[int]], int]:
    """Behind PgBouncer: every server connection to the cell's own database (PgBouncer's, so no worker's
    name), the test's own excepted."""
    name = make_url(direct).database

    def cut(pids: list[int]) -> int:
        engine = create_engine(direct, poolclass=NullPool)
        try:
            with engine.begin() as conn:
                return len(conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                             "WHERE datname = :name AND pid <> pg_backend_pid()"),
                                        {"name": name}).all())
        finally:
            engine.dispose()
    return cut


def _server_down(server: Server) -> Callable[[str, float], None]:
    def down(mode: str, seconds: float) -> None:
        server.stop(mode)
        time.sleep(seconds)
        server.start()
    return down


def _sqlite_lock(path: str) -> Callable[[str, float], None]:
    def down(mode: str, seconds: float) -> None:
        holder = sqlite3.connect(path, isolation_level=None, timeout=30)
        try:
            holder.execute("BEGIN IMMEDIATE")  # the one write lock, held: every worker's write waits
            time.sleep(seconds)
            holder.execute("COMMIT")
        finally:
            holder.close()
    return down


def tables(engine: Engine, partitioned: bool = False) -> None:
    app.queue.create_tables(engine, partitioned=partitioned)
    app.Base.metadata.create_all(engine)


def targets(configuration: str, scenario: str, tmp_path: Path, request: pytest.FixtureRequest,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """The cell's target, set up, yielded, and torn down (its database dropped)."""
    stops_server = scenario in ("restart", "outage")
    if stops_server and configuration != "sqlite":
        fixture = "private_mariadb" if configuration == "mariadb" else "private_cluster"
        yield from _private(configuration, request.getfixturevalue(fixture), monkeypatch)
        return
    if configuration == "pgbouncer":
        with running_pgbouncer() as (through, direct):
            yield from _behind_pgbouncer(through, direct, None, monkeypatch)
        return
    for db in make_database(configuration, tmp_path):
        engine = create_engine(db.url, poolclass=NullPool)  # a cut never leaves the test a dead pooled connection
        tables(engine, db.partitioned)
        monkeypatch.setenv("SQLA_JOBS_URL", db.url)
        cut = {"sqlite": None, "mariadb": _mariadb_cut(str(db.schema))}.get(configuration, _pg_cut(engine))
        down = _sqlite_lock(db.url.removeprefix("sqlite:///")) if configuration == "sqlite" else None
        yield Target(configuration, db.url, engine, cut=cut, down=down)
        engine.dispose()


def _behind_pgbouncer(through: str, direct: str, down: Callable[[str, float], None] | None,
                      monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    engine = create_engine(direct, poolclass=NullPool)
    tables(engine)
    # transaction mode: nothing prepared, no LISTEN (docs/howto/backends.md)
    url = make_url(through).update_query_dict({"prepare_threshold": "none"}).render_as_string(hide_password=False)
    monkeypatch.setenv("SQLA_JOBS_URL", url)
    yield Target("pgbouncer", url, engine, {"no_listen": True}, _bouncer_cut(direct), down)
    engine.dispose()


def _private(configuration: str, server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """A fresh database on a private server (behind PgBouncer for that configuration)."""
    if configuration == "pgbouncer":
        with running_pgbouncer(server.url) as (through, direct):
            yield from _behind_pgbouncer(through, direct, _server_down(server), monkeypatch)
        return
    name = f"m_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server.url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    url = make_url(server.url).set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url, poolclass=NullPool)
    try:
        tables(engine, partitioned=configuration == "postgresql-partitioned")
        monkeypatch.setenv("SQLA_JOBS_URL", url)
        yield Target(configuration, url, engine, down=_server_down(server))
    finally:
        engine.dispose()
        with admin.connect() as conn:
            force = " WITH (FORCE)" if make_url(server.url).get_backend_name() == "postgresql" else ""
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))  # PostgreSQL: its workers' sessions too
        admin.dispose()


class Fleet:
    """The cell's worker processes: a replacement starts for each one a fault takes away."""

    def __init__(self, target: Target, workers: Workers, lease: float, count: int, **options: object) -> None:
        self.target, self.workers, self.lease, self.options = target, workers, lease, options
        self.live: list[WorkerProc] = []
        self.died: dict[int, float] = {}
        self.frozen: dict[int, list[tuple[float, float]]] = {}
        for _ in range(count):
            self.start()

    def start(self, url: str | None = None) -> WorkerProc:
        """A worker on the target, or on ``url`` (through a proxy) with its handlers on the target."""
        worker = self.workers(url or self.target.url, handler_url=self.target.url if url else None,
                              concurrency=4, lease=self.lease, **self.target.options, **self.options)
        self.live.append(worker)
        return worker

    def kill(self, rng: random.Random) -> None:
        worker = rng.choice(self.live)
        worker.signal(signal.SIGKILL)
        self.died[worker.pid] = time.time()
        worker.wait(10)
        self.live.remove(worker)
        self.start()

    def terminate(self, rng: random.Random) -> None:
        # One that has started: a SIGTERM while the interpreter still imports kills it by the default action, before
        # any code of ours can handle it (as for any Python program); the scenario is a graceful stop of a worker.
        worker = rng.choice(wait_for(lambda: [w for w in self.live if w.started()], 60, "a started worker"))
        code = worker.stop(timeout=FAST["grace"] + 10)
        assert code == 0, f"SIGTERM: worker {worker.pid} exited {code}: {worker.log()[-2000:]}"
        self.live.remove(worker)
        self.start()

    def freeze(self, spans: Path) -> float:
        """SIGSTOP a worker in the middle of a run, past its lease (2.5 leases), then SIGCONT it; returns when
        it stopped."""
        worker = self.running(spans)[0]
        worker.signal(signal.SIGSTOP)
        stopped = time.time()
        time.sleep(2.5 * self.lease)
        worker.signal(signal.SIGCONT)
        self.frozen.setdefault(worker.pid, []).append((stopped, time.time()))
        return stopped

    def running(self, spans: Path, among: list[WorkerProc] | None = None) -> list[WorkerProc]:
        """The live workers (of ``among``) in the middle of a run, once there is one."""
        def busy() -> list[WorkerProc]:
            running = {s.pid for s in read_spans(spans) if s.end is None}
            return [w for w in among or self.live if w.pid in running]
        return wait_for(busy, 30, "a worker running a job")

    def stop(self) -> None:
        for worker in self.live:
            # A replacement started by the last fault may still be importing when the jobs run out: a SIGTERM
            # then ends it by the default action (exit -15), as terminate() says; the stop is of a started worker.
            wait_for(worker.started, 60, f"worker {worker.pid} to start before it is stopped")
            code = worker.stop(timeout=FAST["grace"] + 10)
            assert code == 0, f"worker {worker.pid} exited {code}: {worker.log()[-2000:]}"
