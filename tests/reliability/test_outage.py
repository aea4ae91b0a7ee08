"""Database outages: a killed connection, a reset network, the LISTEN connection lost, a server restart.

Workers must log, back off, reconnect and carry on without a restart; no job
is lost and none stays stuck past its lease.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from sqla_jobs import Worker
from tests import app
from tests.conftest import Database

from .cluster import PrivateCluster
from .conftest import Workers, via
from .harness import (
    WorkerProc,
    all_settled,
    check_invariants,
    effects,
    enqueue,
    job,
    states,
    terminate_backends,
    wait_for,
)
from .proxy import TcpProxy

pytestmark = pytest.mark.slow


def drain_and_stop(engine: Engine, ids: list[int], pool: list[WorkerProc], workers: Workers, timeout: float,
                   what: str) -> dict[int, str]:
    """Wait until every job is finished or dead, stop the workers (each alive, each exiting 0), check the
    suite's invariants; returns each job's final state."""
    wait_for(lambda: all_settled(engine, ids), timeout, what)
    for worker in pool:
        assert worker.alive(), "a worker died instead of reconnecting"
        assert worker.stop() == 0
    return check_invariants(engine, ids, workers.logs())


@pytest.mark.parametrize("how", ["pg_terminate_backend", "network reset"])
def test_connection_lost_between_claim_and_finish(pg: Database, workers: Workers, proxy: TcpProxy, how: str) -> None:
    url = pg.url if how == "pg_terminate_backend" else via(proxy, pg)
    # A 60 s lease: the job must be finished by this worker after it reconnects, not recovered by expiry.
    # One thread and a 20 s heartbeat: while the handler runs the worker sends nothing, so the first
    # statement to hit the broken connection is the job's finish, which must be kept and retried.
    # (No LISTEN thread: it would be the one to stumble on the dead connection; it has its own test.)
    worker = workers(url, handler_url=pg.url, lease=60, heartbeat=20, concurrency=1, no_listen=True)
    [job_id] = enqueue(pg.engine, "record", {"sleep": 1.5})
    wait_for(lambda: effects(pg.engine, job_id, "start"), 30, "the handler to start")
    if how == "pg_terminate_backend":
        assert terminate_backends(pg.engine, worker.pid) >= 1
    else:
        # Hold the worker's traffic until its finish is on the wire, then reset.
        proxy.stall()
        wait_for(lambda: effects(pg.engine, job_id, "finish"), 30, "the handler to finish")
        time.sleep(0.5)
        assert proxy.cut() >= 1
        proxy.resume()
    wait_for(lambda: all_settled(pg.engine, [job_id]), 20, "the worker to reconnect and record the finish")
    # The finish itself failed, was kept in memory and written after reconnecting. The worker logs
    # "database is back" after that write returns, so the row can be seen before the line: wait for it.
    wait_for(lambda: "database is back" in worker.log(), 10, "the worker to log that the database is back")
    assert "database error" in worker.log()
    row = job(pg.engine, job_id)
    assert (row.state, row.attempts) == ("finished", 1), "finished by the same worker, no retry"

    more = enqueue(pg.engine, "record", n=5)
    wait_for(lambda: all_settled(pg.engine, more), 20, "the worker to carry on")
    assert worker.stop() == 0
    check_invariants(pg.engine, [job_id, *more], workers.logs())


def test_listen_connection_recovers(pg: Database, workers: Workers) -> None:
    # Long heartbeat and poll: within seconds, only a NOTIFY on a LISTEN connection can wake the worker.
    worker = workers(pg.url, lease=90, heartbeat=30, poll_interval=30)
    wait_for(lambda: "started" in worker.log(), 30, "the worker to start")
    [warm] = enqueue(pg.engine, "record")
    wait_for(lambda: all_settled(pg.engine, [warm]), 10, "a NOTIFY to wake the worker")
    assert terminate_backends(pg.engine, worker.pid) >= 1
    wait_for(lambda: "LISTEN connection failed" in worker.log(), 10, "the LISTEN thread to notice")
    time.sleep(2.5)  # its first reconnect comes after 1 s
    [job_id] = enqueue(pg.engine, "record")
    wait_for(lambda: all_settled(pg.engine, [job_id]), 10, "a NOTIFY on the re-established LISTEN connection")
    assert worker.stop() == 0
    check_invariants(pg.engine, [warm, job_id], workers.logs())


def test_server_restart_under_load(private_cluster: PrivateCluster, private_db: Database, workers: Workers) -> None:
    engine = private_db.engine
    pool = [workers(private_db.url, concurrency=3) for _ in range(2)]
    ids = enqueue(engine, "record", {"sleep": 0.1}, n=60, max_attempts=10)
    wait_for(lambda: len(effects(engine, event="finish")) >= 10, 30, "the workers to get going")
    wait_for(lambda: all(w.started() for w in pool), 60, "every worker to start")  # one may have done all 10
    private_cluster.stop("fast")
    time.sleep(3)  # longer than the 2 s lease: running jobs' leases expire meanwhile
    private_cluster.start()
    ids += enqueue(engine, "record", n=10, max_attempts=10)
    wait_for(lambda: all_settled(engine, ids), 90, "every job to finish after the restart")
    for worker in pool:
        assert worker.alive(), "a worker died instead of reconnecting"
        assert "database is back" in worker.log()
        assert worker.stop() == 0
    states = check_invariants(engine, ids, workers.logs())
    assert set(states.values()) == {"finished"}


def test_an_outage_longer_than_the_lease_charges_nothing_and_runs_nothing_twice(
    private_cluster: PrivateCluster, private_db: Database, workers: Workers, tmp_path: Path
) -> None:
    """The server goes down for twice the lease while handlers run, with ``max_attempts=1`` (issue 32).

    Every running job's lease runs out during the outage while its worker lives. The workers stop their
    handlers (self-fencing; these ignore the cancel and sleep on), keep the leases of those still running
    once the server is back, and hand each job back when its handler has returned; the reaper gives live
    workers a lease to renew before it reaps. So: nothing dead-lettered, no attempt charged, and a job that
    runs again does so after its first run ended, never beside it.
    """
    engine = private_db.engine
    runs = tmp_path / "runs"  # the handlers' record: a file, which the outage cannot take away
    pool = [workers(private_db.url, concurrency=3) for _ in range(2)]  # harness FAST: 2 s lease, 0.5 s heartbeat
    ids = enqueue(engine, "timed", {"sleep": 6.0, "runs": str(runs)}, n=12, max_attempts=1)
    wait_for(lambda: list(states(engine, ids).values()).count("running") == 6, 30, "six jobs to be running")
    private_cluster.stop("fast")
    time.sleep(4.0)  # twice the lease: the running jobs' leases run out; their handlers run on
    private_cluster.start()
    final = drain_and_stop(engine, ids, pool, workers, 90, "every job to finish after the outage")
    assert set(final.values()) == {"finished"}, f"not all finished (dead-lettered by the outage?): {final}"
    lines = [line.split() for line in runs.read_text().splitlines()]
    assert {int(line[0]) for line in lines} == set(ids)
    for job_id in ids:
        spans = sorted((float(start), float(end)) for jid, _, _, start, end in lines if int(jid) == job_id)
        overlapping = [(a, b) for a, b in itertools.pairwise(spans) if b[0] < a[1]]
        assert not overlapping, f"job {job_id} ran twice at once: {spans}"
    with engine.connect() as conn:
        charged = conn.execute(text("select id, attempts from jobs where id = any(:ids) and attempts <> 1"),
                               {"ids": ids}).all()
    assert not charged, f"attempts charged by the outage: {charged}"


def _read_only(engine: Engine, on: bool) -> None:
    """Switch the server's default_transaction_read_only (what a standby's sessions see), for every session."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("SET default_transaction_read_only = off"))  # this session stays writable
        conn.execute(text(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}"))
        conn.execute(text("SELECT pg_reload_conf()"))


def test_a_read_only_server_is_waited_out_without_charging_attempts(
    private_cluster: PrivateCluster, private_db: Database, workers: Workers
) -> None:
    """The server takes no writes for twice the lease mid-drain (a standby; an operator's switch), with
    ``max_attempts=1`` (issue 32): one clear line per worker, nothing claimed meanwhile, no attempt charged
    for the handlers' refused writes, no lease reaped under a live worker, and the drain resumes."""
    engine = private_db.engine
    pool = [workers(private_db.url, concurrency=2) for _ in range(2)]  # harness FAST: 2 s lease
    ids = enqueue(engine, "record", {"sleep": 0.3}, n=40, max_attempts=1)
    wait_for(lambda: len(effects(engine, event="finish")) >= 4, 30, "the workers to get going")
    _read_only(engine, True)
    try:
        time.sleep(1.0)  # the runs under way end, their writes refused
        finished = list(states(engine, ids).values()).count("finished")
        time.sleep(3.0)
        assert list(states(engine, ids).values()).count("finished") == finished, "a write went through"
    finally:
        _read_only(engine, False)
    wait_for(lambda: all_settled(engine, ids), 90, "every job to finish once the server is writable")
    for worker in pool:
        assert worker.alive(), "a worker died instead of waiting"
        assert worker.log().count("takes no writes") == 1, worker.log()
        assert "database is back and writable" in worker.log()
        assert worker.stop() == 0
    final = check_invariants(engine, ids, workers.logs())
    assert set(final.values()) == {"finished"}, f"not all finished (charged for the read-only time?): {final}"


def test_pool_exhausted_by_transactional_handlers_does_not_kill_the_worker(pg: Database) -> None:
    """Transactional handlers hold pool connections while they run; the control thread then waits for one.

    A pool timeout during a heartbeat is a database outage like any other: back off, carry on.
    """
    engine = create_engine(pg.url, pool_size=2, max_overflow=0, pool_timeout=0.2)
    try:
        ids = enqueue(engine, "once", {"sleep": 1.0}, n=4)
        worker = Worker(engine, app.queue, concurrency=2, lease=3, heartbeat=0.3, poll_interval=0.1, listen=False)
        done: list[int] = []
        runner = threading.Thread(target=lambda: done.append(worker.run(burst=True, install_signals=False)))
        runner.start()
        runner.join(60)
        assert done == [0], "the worker died instead of backing off"
        states = check_invariants(engine, ids)
        assert set(states.values()) == {"finished"}
    finally:
        engine.dispose()


def test_server_restarts_do_not_use_up_attempts(
    private_cluster: PrivateCluster, private_db: Database, workers: Workers
) -> None:
    """Three restarts during a drain with max_attempts=2: an outage of the queue database is not the job's
    fault, so nothing is dead-lettered, every job finishes, and no job is charged an attempt for an outage.

    Half the jobs are transactional (their session is the worker's), half write through the app's own
    engine on the same database; both kinds are in the middle of a write when the server goes away.
    """
    engine = private_db.engine
    # A 60 s lease: leases outlive the outages, so only the handlers' failures could charge attempts.
    pool = [workers(private_db.url, concurrency=3, lease=60, heartbeat=0.5) for _ in range(2)]
    ids = []
    for _ in range(150):
        ids += enqueue(engine, "once", {"sleep": 0.1}, max_attempts=2)
        ids += enqueue(engine, "record", {"sleep": 0.1}, max_attempts=2)

    def finished() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text("select count(*) from jobs where state = 'finished'")).scalar_one())

    # Restart at a quarter, half and three quarters of the drain: always while jobs remain.
    for quarter, mode in enumerate(("fast", "immediate", "fast"), start=1):
        wait_for(lambda: finished() >= quarter * len(ids) // 4, 120, "the workers to get going again")  # noqa: B023
        private_cluster.stop(mode)
        time.sleep(1.5)
        private_cluster.start()
    states = drain_and_stop(engine, ids, pool, workers, 180, "every job to finish after the restarts")
    dead_letters = sorted(job_id for job_id, state in states.items() if state == "dead")
    assert not dead_letters, f"dead-lettered by outages: {dead_letters}"
    assert set(states.values()) == {"finished"}
    with engine.connect() as conn:
        rows = conn.execute(text("select id, attempts, errors from jobs where id = any(:ids)"), {"ids": ids}).all()
    charged = {r.id: r.errors for r in rows if r.attempts != 1}
    assert not charged, f"{len(charged)} job(s) charged for outages, e.g. {list(charged.items())[:3]}"
    interrupted = [r.id for r in rows if any("attempt not counted" in e["error"] for e in r.errors or [])]
    assert interrupted, "no handler was interrupted by the restarts: the test proved nothing"
