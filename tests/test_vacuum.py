"""``sqla-jobs worker --vacuum-dead-rows N`` (``sqla_jobs.worker.vacuum``): the worker that does the upkeep
vacuums the jobs table once the server counts N dead rows in it, on PostgreSQL; elsewhere it says
that it does nothing; a role that may not vacuum is told what to do, once.

The evidence is the server's own: ``pg_stat_user_tables.vacuum_count`` counts the VACUUMs run on
the table (autovacuum's are counted apart, so a server with autovacuum on cannot pass for us).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from sqla_jobs.drivers.postgresql.vacuum import AUTOVACUUM
from sqla_jobs.worker.vacuum import Vacuumer
from tests import app, forkserver
from tests.conftest import PG_URL, ROOT, Database, make_database, require_postgres
from tests.helpers import count, run_burst
from tests.test_processes import wait_until

JOBS = 1500


def _vacuums(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = to_regclass('jobs')")).scalar_one())


def _enqueue(db: Database, n: int) -> None:
    with Session(db.engine) as session, session.begin():
        app.queue.enqueue_many(session, ({"kind": "noop", "payload": {"i": i}} for i in range(n)))


def _worker(db: Database, log: Path, *options: str) -> forkserver.Popen:
    """``sqla-jobs worker`` logging at INFO into ``log`` (a file: a line per job would fill a pipe and stall it)."""
    command = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "INFO", "worker", "--app", "tests.app:queue",
               "--concurrency", "8", "--poll-interval", "0.2", *options]
    with log.open("w") as out:
        return forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)


def _stop(worker: forkserver.Popen, log: Path) -> str:
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=60)
    output = log.read_text()
    assert worker.returncode == 0, output
    return output


@pytest.mark.parametrize("threshold", [500, None], ids=["vacuum-dead-rows", "off"])
def test_the_worker_vacuums_the_jobs_table_once_it_holds_that_many_dead_rows(
        db: Database, threshold: int | None, tmp_path: Path) -> None:
    _enqueue(db, JOBS)  # each job leaves two dead row versions behind: its claim's and its finish's
    log = tmp_path / "worker.log"
    worker = _worker(db, log, *(["--vacuum-dead-rows", str(threshold)] if threshold else []))
    try:
        wait_until(lambda: count(db.engine, app.Job, app.Job.state == "finished") == JOBS, 60, "the jobs to run")
        if db.backend == "postgresql" and threshold:
            wait_until(lambda: _vacuums(db) >= 1, 30, "the worker's VACUUM")
        elif threshold:
            wait_until(lambda: "the worker does not vacuum" in log.read_text(), 30, "the worker to say it won't")
        else:
            time.sleep(3)  # time for a vacuum that must not come (the worker looks once a second)
    finally:
        stderr = _stop(worker, log)
    if db.backend != "postgresql":
        assert ("reclaims dead rows itself; the worker does not vacuum" in stderr) == bool(threshold), stderr
        return
    if threshold:
        assert "vacuumed jobs:" in stderr, stderr
    else:
        assert _vacuums(db) == 0 and "vacuumed" not in stderr, stderr


def test_the_async_worker_vacuums_too(pg: Database, tmp_path: Path) -> None:
    app.queue.create_tables(pg.engine)
    _enqueue(pg, JOBS)
    log = tmp_path / "worker.log"
    worker = _worker(pg, log, "--async", "--vacuum-dead-rows", "500")
    try:
        wait_until(lambda: count(pg.engine, app.Job, app.Job.state == "finished") == JOBS, 60, "the jobs to run")
        wait_until(lambda: _vacuums(pg) >= 1, 30, "the async worker's VACUUM")
    finally:
        stderr = _stop(worker, log)
    assert "started (async)" in stderr and "vacuumed jobs:" in stderr, stderr


def test_a_role_that_may_not_vacuum_is_told_what_to_do(pg: Database, caplog: pytest.LogCaptureFixture) -> None:
    app.queue.create_tables(pg.engine)
    _enqueue(pg, 200)
    with pg.engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET priority = 1"))  # 200 dead rows
    role = f"sqla_jobs_t_{uuid.uuid4().hex[:8]}"
    with pg.engine.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(text(f'GRANT USAGE ON SCHEMA "{pg.schema}" TO "{role}"'))
        conn.execute(text(f'GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA "{pg.schema}" TO "{role}"'))
    engine = create_engine(make_url(pg.url).set(username=role))
    try:
        def dead_rows() -> int:
            with pg.engine.connect() as conn:
                return app.queue.driver(conn).dead_rows(conn) or 0

        wait_until(lambda: dead_rows() >= 200, 30, "the stats")
        vacuumer = Vacuumer(app.queue, engine, 100, lambda: True)
        with caplog.at_level(logging.INFO, logger="sqla_jobs.worker"):
            assert vacuumer.check() is None  # never on this database: the thread stops
        [message] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert "may not VACUUM jobs" in message and "Connect as the table's owner" in message
        assert vacuumer.vacuums == 0 and _vacuums(pg) == 0
        # The owner may: the same check vacuums.
        assert Vacuumer(app.queue, pg.engine, 100, lambda: True).check() is True
        wait_until(lambda: _vacuums(pg) == 1, 10, "the owner's VACUUM in the statistics")
    finally:
        engine.dispose()
        with create_engine(PG_URL).begin() as conn:
            conn.execute(text(f'DROP OWNED BY "{role}"'))
            conn.execute(text(f'DROP ROLE "{role}"'))


def test_the_claim_walk_bench_reports_each_second(tmp_path: Path) -> None:
    """docs/bench/claim_walk.py, which docs/performance.md quotes, on a small drain."""
    require_postgres()
    out = forkserver.run(
        [sys.executable, str(ROOT / "docs" / "bench" / "claim_walk.py"), "--url", PG_URL, "--jobs", "30000",
         "--vacuum-dead-rows", "2000"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    seconds = [line for line in out.stdout.splitlines() if line.startswith("t=")]
    # Each second: the walk's time and buffers, and the server's counters (whether a vacuum falls within so
    # short a drain is timing; the tests above prove the worker's vacuum).
    assert seconds and all(re.search(r"walk=\d+\.\d+ms buffers=\d+ .* vacuums=\d+ dead=\d+$", line)
                           for line in seconds), out.stdout
    assert seconds[-1].split("left=")[1].split()[0] == "0" and "drain:" in out.stdout.splitlines()[-1], out.stdout


def test_only_the_elected_worker_vacuums(pg: Database, tmp_path: Path) -> None:
    """Two workers with the option: the one that holds the maintenance lease vacuums, the other never does."""
    app.queue.create_tables(pg.engine)
    _enqueue(pg, JOBS)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    workers = [_worker(pg, log, "--vacuum-dead-rows", "500") for log in logs]
    try:
        wait_until(lambda: count(pg.engine, app.Job, app.Job.state == "finished") == JOBS, 60, "the jobs to run")
        # Dead rows keep coming for 5 s (1,500 per update), so each worker's look once a second finds
        # more than 500: whichever is not elected would vacuum too, were it allowed to.
        for _ in range(10):
            with pg.engine.begin() as conn:
                conn.execute(text("UPDATE jobs SET priority = priority + 1"))
            time.sleep(0.5)
        wait_until(lambda: _vacuums(pg) >= 2, 30, "the VACUUMs")
    finally:
        outputs = [_stop(worker, log) for worker, log in zip(workers, logs, strict=True)]
    leading = ["leads jobs_leader" in output for output in outputs]
    vacuumed = ["vacuumed jobs:" in output for output in outputs]
    assert sorted(leading) == [False, True] and vacuumed == leading, outputs


def _waiting_for(pg: Database, pid: int) -> list[str]:
    """The lock modes the backend ``pid`` is waiting for."""
    with pg.engine.connect() as conn:
        return list(conn.execute(text("SELECT mode FROM pg_locks WHERE pid = :pid AND NOT granted"),
                                 {"pid": pid}).scalars())


def test_workers_claim_and_finish_while_a_vacuum_holds_its_lock(pg: Database) -> None:
    """What lets the worker vacuum during a burst: VACUUM's table lock (SHARE UPDATE EXCLUSIVE) does
    not stop the claims and finishes. The lock is held by a transaction of the test's, with a VACUUM
    queued behind it (its wait, seen in ``pg_locks``, shows the mode it takes): a worker drains the
    queue meanwhile, through its real claim and finish."""
    app.queue.create_tables(pg.engine)
    _enqueue(pg, 300)
    holder = pg.engine.connect()
    holder.begin()
    holder.execute(text("LOCK TABLE jobs IN SHARE UPDATE EXCLUSIVE MODE"))
    vacuum_engine = create_engine(pg.url, isolation_level="AUTOCOMMIT")
    vacuum = vacuum_engine.connect()
    vacuum_pid = int(vacuum.execute(text("SELECT pg_backend_pid()")).scalar_one())
    done = threading.Event()

    def run_vacuum() -> None:
        vacuum.execute(text("VACUUM jobs"))  # waits for the holder's lock
        done.set()

    thread = threading.Thread(target=run_vacuum, daemon=True)
    thread.start()
    burst = threading.Thread()  # replaced by the worker's once the VACUUM waits
    try:
        wait_until(lambda: _waiting_for(pg, vacuum_pid) == ["ShareUpdateExclusiveLock"], 10, "the VACUUM to queue")
        processed: list[int] = []
        burst = threading.Thread(target=lambda: processed.append(run_burst(pg.engine, concurrency=4).processed))
        burst.start()
        burst.join(60)
        assert not burst.is_alive(), "the worker's claims waited for VACUUM's lock"
        assert processed == [300] and count(pg.engine, app.Job, app.Job.state == "finished") == 300
        assert not done.is_set() and _waiting_for(pg, vacuum_pid) == ["ShareUpdateExclusiveLock"]
    finally:
        holder.rollback()
        holder.close()
        if burst.is_alive():
            burst.join(30)
        thread.join(30)
        vacuum.close()
        vacuum_engine.dispose()
    assert done.is_set()


def table_settings(db: Database, table: str = "jobs") -> dict[str, str]:
    """A table's storage parameters as PostgreSQL keeps them (``pg_class.reloptions``)."""
    with db.engine.connect() as conn:
        options = conn.execute(text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
                               {"t": table}).scalar_one()
    return dict(option.split("=", 1) for option in options or [])


def test_a_jobs_table_made_by_create_all_vacuums_by_a_count_of_dead_rows(pg: Database) -> None:
    # The server's default (20 % of the table dead) never comes for a table that keeps millions of
    # finished jobs, while each claim walks the dead entries earlier claims left (docs/performance.md).
    assert table_settings(pg) == AUTOVACUUM == {"autovacuum_vacuum_scale_factor": "0",
                                                "autovacuum_vacuum_threshold": "20000"}
    assert table_settings(pg, "dead_jobs") == {}  # the dead letters see few updates: the server's defaults


def test_create_tables_gives_the_jobs_table_its_settings_once_and_leaves_a_users_own(tmp_path: Path) -> None:
    for db in make_database("postgresql", tmp_path):
        app.queue.create_tables(db.engine)
        assert table_settings(db) == AUTOVACUUM
        with db.engine.begin() as conn:  # an operator's own tuning of an existing table
            conn.execute(text("ALTER TABLE jobs SET (autovacuum_vacuum_threshold = 5000, fillfactor = 80)"))
        app.queue.create_tables(db.engine)  # creates what is missing, changes nothing that exists
        assert table_settings(db) == {**AUTOVACUUM, "autovacuum_vacuum_threshold": "5000", "fillfactor": "80"}
