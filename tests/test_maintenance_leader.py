"""The worker's upkeep (reaping, pruning) runs on the elected worker only (sqla_jobs.leader), passes on
at a stop, and falls back to every worker when the lease cannot work."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select, text

from sqla_jobs import Worker
from sqla_jobs.leader import leader_table
from tests import app
from tests.conftest import Database
from tests.test_stats import db_now

LEASE = 1.5  # heartbeat: every 0.5 s


def start(db: Database, name: str, **options: Any) -> tuple[Worker, threading.Thread]:
    worker = Worker(db.engine, app.queue, name=name, lease=LEASE, poll_interval=0.05, **options)
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    return worker, thread


def stop(*workers: tuple[Worker, threading.Thread]) -> None:
    for worker, _ in workers:
        worker.stop()
    for _, thread in workers:
        thread.join(30)
        assert not thread.is_alive()


def holder(db: Database) -> str | None:
    table = leader_table(app.queue)
    with db.engine.connect() as conn:
        if not db.engine.dialect.has_table(conn, table.name):
            return None
        row = conn.execute(select(table.c.holder, table.c.expires_at)).first()
    return None if row is None else str(row.holder)


def wait_for(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def stranded_job(db: Database) -> int:
    """A job left running by a worker that vanished: its lease ran out a minute ago."""
    now = db_now(db.engine)
    with db.engine.begin() as conn:
        return int(conn.execute(insert(app.Job.__table__).values(
            kind="noop", payload={}, state="running", attempts=1, locked_by="ghost", claim_token="gone",
            locked_at=now - timedelta(minutes=2), lease_expires_at=now - timedelta(minutes=1),
        )).inserted_primary_key[0])


def state_of(db: Database, job_id: int) -> str:
    with db.engine.connect() as conn:
        return str(conn.execute(select(app.Job.state).where(app.Job.id == job_id)).scalar_one())


def test_one_worker_leads_the_upkeep_and_hands_it_over_when_it_stops(db: Database) -> None:
    first = start(db, "first")
    wait_for(lambda: holder(db) == "first", "the first worker never led")
    second = start(db, "second")
    time.sleep(LEASE)  # several heartbeats of the second worker: it does not take the lease
    assert holder(db) == "first"
    assert second[0]._maintenance.acting is False and first[0]._maintenance.acting is True
    stop(first)  # hands the lease over: the second takes it at its next heartbeat, not a lease later
    wait_for(lambda: holder(db) == "second", "the second worker did not take over", timeout=LEASE)
    job = stranded_job(db)
    wait_for(lambda: state_of(db, job) == "finished", "the new leader did not reap the stranded job")
    stop(second)


def test_without_an_election_every_worker_reaps(db: Database) -> None:
    worker = start(db, "alone", leader=False)
    job = stranded_job(db)
    wait_for(lambda: state_of(db, job) == "finished", "the worker did not reap")
    stop(worker)
    with db.engine.connect() as conn:
        assert not db.engine.dialect.has_table(conn, leader_table(app.queue).name)  # no election held


def test_a_lease_that_cannot_work_leaves_the_upkeep_to_every_worker(db: Database, caplog: Any) -> None:
    # A table of that name with another shape (as a failed or foreign migration would leave).
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {leader_table(app.queue).name} (something INTEGER)"))
    caplog.set_level(logging.ERROR, logger="sqla_jobs")
    worker = start(db, "stubborn")
    job = stranded_job(db)
    wait_for(lambda: state_of(db, job) == "finished", "nobody reaped while the lease was broken")
    stop(worker)
    assert any("does its own maintenance" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("option", ["--no-leader"])
def test_the_cli_takes_no_leader(option: str) -> None:
    from sqla_jobs.cli import build_parser

    args = build_parser().parse_args(["worker", "--app", "tests.app:queue", option])
    assert args.no_leader is True
