"""Recovery time after dropped connections and server restarts (issue 9, findings 1 and 5).

A worker with default settings and a warm pool loses every connection at once
(``pg_terminate_backend`` on all its backends, or a restart of the server).
The database answers again at once, so the worker must too: jobs enqueued
right after run within 2 s (the median of several cuts, a generous margin
against a noisy machine). Before the fix each stale pooled connection cost
one doubled backoff and these jobs waited ~16 s.
"""

from __future__ import annotations

import socket
import statistics
import time
import uuid

import pytest
from sqlalchemy import Connection, Engine, create_engine, make_url, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from sqla_jobs.drivers.postgresql.keepalive import harden, is_disconnect
from sqla_jobs.worker.reconnect import database_answers
from tests.conftest import Database

from .cluster import PrivateCluster
from .conftest import Workers
from .harness import WorkerProc, all_settled, check_invariants, enqueue, terminate_backends, wait_for

pytestmark = pytest.mark.slow

# None drops the harness's short test settings: the worker runs with the CLI defaults
# (lease 60 s, heartbeat 20 s, poll 1 s), as in production.
DEFAULTS = {"lease": None, "heartbeat": None, "poll_interval": None, "grace": None}
BOUND = 2.0  # seconds, the target


def warm(engine: Engine, worker: WorkerProc, ids: list[int]) -> None:
    """16 transactional jobs: each handler holds a pooled connection, so the pool fills up."""
    warmup = enqueue(engine, "once", {"sleep": 0.2}, n=16)
    ids += warmup
    wait_for(lambda: all_settled(engine, warmup), 30, "the warm-up jobs")
    time.sleep(0.3)  # idle: every connection is back in the pool or idle on the hot path


def time_to_run(engine: Engine, ids: list[int]) -> float:
    """Enqueue 4 transactional jobs (they draw pooled connections) and time until all are finished."""
    started = time.monotonic()
    batch = enqueue(engine, "once", n=4)
    ids += batch
    wait_for(lambda: all_settled(engine, batch), 60, "the jobs enqueued after the cut", interval=0.02)
    return time.monotonic() - started


@pytest.mark.serial  # a time bound: measured on a machine no other test is loading
@pytest.mark.parametrize("concurrency", [8, 64])
def test_jobs_run_within_2s_after_all_backends_are_terminated(pg: Database, workers: Workers,
                                                               concurrency: int) -> None:
    worker = workers(pg.url, concurrency=concurrency, **DEFAULTS)
    wait_for(lambda: "started" in worker.log(), 30, "the worker to start")
    ids: list[int] = []
    times = []
    for _ in range(5):
        warm(pg.engine, worker, ids)
        killed = terminate_backends(pg.engine, worker.pid)
        assert killed >= 3, f"only {killed} backends to cut: the pool was not warm"
        times.append(time_to_run(pg.engine, ids))
    print(f"concurrency {concurrency}: recovery after cutting all backends {[round(t, 2) for t in times]} s")
    assert worker.alive()
    assert statistics.median(times) < BOUND, f"recovery took {times} s (median over {BOUND} s)"
    assert worker.stop() == 0
    states = check_invariants(pg.engine, ids, workers.logs())
    assert set(states.values()) == {"finished"}


@pytest.mark.serial  # a time bound, as above
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_jobs_run_within_2s_after_each_server_restart(private_cluster: PrivateCluster, private_db: Database,
                                                       workers: Workers, mode: str) -> None:
    engine = private_db.engine
    worker = workers(private_db.url, concurrency=8, **DEFAULTS)
    wait_for(lambda: "started" in worker.log(), 30, "the worker to start")
    ids: list[int] = []
    times = []
    for _ in range(3):
        warm(engine, worker, ids)
        # The private cluster runs with synchronous_commit=off: an immediate stop (a crash, to
        # PostgreSQL) would lose the last commits, the warm-up jobs' finishes among them. Flush first.
        with engine.connect() as conn:
            conn.execute(text("CHECKPOINT"))
        private_cluster.stop(mode)
        time.sleep(1.0)  # down for a second: the worker's retries find nobody there
        private_cluster.start()  # returns once the server accepts connections
        times.append(time_to_run(engine, ids))
    print(f"{mode} restarts: recovery {[round(t, 2) for t in times]} s")
    assert worker.alive(), "the worker died instead of reconnecting"
    # Each restart, not just on average: backoff must not grow from one outage to the next.
    assert statistics.median(times) < BOUND and max(times) < 2 * BOUND, f"recovery took {times} s"
    assert worker.stop() == 0
    states = check_invariants(engine, ids, workers.logs())
    assert set(states.values()) == {"finished"}


def backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_checkout_replaces_every_connection_the_server_closed(pg: Database) -> None:
    """What makes the recovery fast: no pooled connection the server closed is ever handed out."""
    engine = create_engine(pg.url, pool_size=5, max_overflow=0)
    harden(engine, f"checkout-test-{uuid.uuid4().hex[:8]}")
    try:
        held = [engine.connect() for _ in range(5)]
        old = {backend_pid(conn) for conn in held}
        for conn in held:
            conn.close()  # back to the pool, idle
        with pg.engine.connect() as admin:
            admin.execute(text("SELECT pg_terminate_backend(pid) FROM unnest(CAST(:pids AS int[])) AS pid"),
                          {"pids": list(old)})
        time.sleep(0.2)  # the server's goodbye reaches the sockets
        # All five at once: each is a new session, none fails on a stale socket.
        held = [engine.connect() for _ in range(5)]
        new = {backend_pid(conn) for conn in held}
        assert len(new) == 5 and not new & old
        for conn in held:
            conn.close()
    finally:
        engine.dispose()


def wrapped(engine: Engine, sql: str) -> BaseException:
    """Run ``sql`` on the driver's cursor and wrap its error the way the worker's hot path does."""
    with engine.connect() as conn:
        try:
            with conn.connection.driver_connection.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(sql)
        except Exception as exc:
            return DBAPIError.instance(sql, None, exc, conn.dialect.loaded_dbapi.Error)
        finally:
            conn.invalidate()
    raise AssertionError(f"{sql!r} did not fail")


def test_disconnects_are_told_from_statement_errors(pg: Database) -> None:
    engine = create_engine(pg.url, poolclass=NullPool)
    # Statement errors: the connection is fine, the worker must not treat them as an outage.
    assert not is_disconnect(wrapped(engine, "SELECT * FROM no_such_table"))
    assert not is_disconnect(wrapped(engine, "SET statement_timeout = 1; SELECT pg_sleep(1)"))
    # The server ends the session (what pg_terminate_backend and a fast shutdown do).
    assert is_disconnect(wrapped(engine, "SELECT pg_terminate_backend(pg_backend_pid())"))
    # Nobody listens on the port: no SQLSTATE, an OperationalError from connecting.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nobody = create_engine(make_url(pg.url).set(host="127.0.0.1", port=port), poolclass=NullPool)
    with pytest.raises(DBAPIError) as refused:
        nobody.connect()
    assert is_disconnect(refused.value)
    assert not database_answers(nobody) and database_answers(engine)
    assert not is_disconnect(ValueError("not a database error"))
