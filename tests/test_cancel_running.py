"""Cancelling a running job: the request reaches the handler at the worker's next heartbeat, and the job
ends ``cancelled`` however the handler then stops (docs/howto/cancelling.md)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import Worker
from tests.app import DeadJob, Once, queue
from tests.conftest import Database, run_cli
from tests.test_operations import APP, _start_worker, _stop, _wait_for, effects, enqueue, job_row


class Running:
    """A worker in a thread of this process, with a short heartbeat so requests arrive fast.

    The lease is long: a cancel needs only the heartbeat, and with a short one a database slowed for a few
    seconds by a loaded machine made the worker stop its jobs itself (self-fencing) and run them again.
    """

    def __init__(self, db: Database, **settings: Any) -> None:
        self.worker = Worker(db.engine, queue, concurrency=2, poll_interval=0.05, lease=30.0, heartbeat=0.2,
                             **settings)
        self.thread = threading.Thread(target=self.worker.run, kwargs={"install_signals": False}, daemon=True)

    def __enter__(self) -> Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self.thread.join(60)


def cancel(db: Database, job_id: int) -> str:
    with Session(db.engine) as session, session.begin():
        return queue.cancel(session, job_id)


def dead_count(db: Database) -> int:
    with Session(db.engine) as session:
        return int(session.scalar(select(func.count()).select_from(DeadJob)) or 0)


@pytest.mark.parametrize(("kind", "mode", "said"), [
    ("cooperative", "return", "cancelled on request: the handler returned"),
    ("cooperative", "raise", "cancelled on request: JobCancel: cancel requested"),
    ("cooperative", "error", "cancelled on request: RuntimeError: stopping because of the request"),
    ("cooperative_async", None, "cancelled on request: CancelledError"),
])
def test_the_request_reaches_the_handler_and_the_job_ends_cancelled(db: Database, kind: str, mode: str | None,
                                                                    said: str) -> None:
    job_id = enqueue(db, kind, payload={"mode": mode} if mode else {}, max_attempts=1)
    with Running(db):
        _wait_for(lambda: effects(db, job_id) == ["start"])
        assert cancel(db, job_id) == "requested"
        _wait_for(lambda: job_row(db, job_id).state != "running", timeout=20)
    assert effects(db, job_id) == ["start", "cancelled"]  # the handler itself saw the request
    row = job_row(db, job_id)
    assert (row.state, row.attempts, row.result) == ("cancelled", 1, None)
    assert row.last_error == said and row.finished_at is not None and row.cancelled_at is not None
    assert dead_count(db) == 0  # on its last attempt, yet no dead letter


def test_a_handler_that_ignores_the_request_runs_to_its_end_and_still_ends_cancelled(db: Database) -> None:
    job_id = enqueue(db, "cooperative", payload={"mode": "ignore", "seconds": 1.5})
    with Running(db):
        _wait_for(lambda: effects(db, job_id) == ["start"])
        cancel(db, job_id)
        _wait_for(lambda: job_row(db, job_id).state != "running", timeout=20)
    assert effects(db, job_id) == ["start", "finish"]  # never interrupted: a thread cannot be stopped
    row = job_row(db, job_id)
    assert (row.state, row.result) == ("cancelled", None)  # its return value is not kept
    assert row.last_error == "cancelled on request: the handler returned"


def _transactional_rolled_back(db: Database) -> None:
    job_id = enqueue(db, "cooperative_tx")
    with Running(db):
        _wait_for(lambda: job_row(db, job_id).state == "running")
        cancel(db, job_id)
        _wait_for(lambda: job_row(db, job_id).state != "running", timeout=20)
    assert job_row(db, job_id).state == "cancelled"
    with Session(db.engine) as session:  # its write did not commit
        assert session.scalar(select(func.count()).select_from(Once).where(Once.job_id == job_id)) == 0


# Not on SQLite: there a transactional handler holds the database's only write lock while it runs, so
# nobody can record a cancel request (nor can its worker heartbeat) until it ends (docs/howto/cancelling.md).
def test_a_transactional_handler_is_rolled_back_when_the_request_reaches_it_pg(pg: Database) -> None:
    _transactional_rolled_back(pg)


def test_a_transactional_handler_is_rolled_back_when_the_request_reaches_it_mariadb(mariadb: Database) -> None:
    _transactional_rolled_back(mariadb)


def test_other_jobs_of_the_worker_are_untouched(db: Database) -> None:
    victim = enqueue(db, "cooperative", payload={"mode": "return"})
    bystander = enqueue(db, "sleep", payload={"seconds": 1.0})
    with Running(db):
        _wait_for(lambda: effects(db, victim) == ["start"] and effects(db, bystander) == ["start"])
        cancel(db, victim)
        _wait_for(lambda: job_row(db, bystander).state == "finished", timeout=20)
    assert job_row(db, victim).state == "cancelled"
    assert effects(db, bystander) == ["start", "finish"]


def test_cli_cancel_reaches_a_worker_process(db: Database) -> None:
    """Across processes, through the command line: the worker process hears of it at a heartbeat."""
    job_id = enqueue(db, "cooperative", payload={"mode": "return"})
    worker = _start_worker(db, "--lease", "30", "--heartbeat", "0.2")
    try:
        _wait_for(lambda: effects(db, job_id) == ["start"])
        result = run_cli("jobs", "cancel", str(job_id), *APP, env=db.env())
        # From the request's commit, not from the command's start: a loaded machine takes seconds to
        # start a Python process, which says nothing about how soon the worker hears of the request.
        started = time.monotonic()
        assert result.returncode == 0, result.stderr
        assert "is running: cancel requested" in result.stdout
        assert "ignores it" in result.stdout  # the output says what happens then
        _wait_for(lambda: job_row(db, job_id).state == "cancelled", timeout=20)
        assert time.monotonic() - started < 15
    finally:
        out = _stop(worker)
    assert f"job {job_id} cooperative: cancel requested; its handler was told" in out
    assert effects(db, job_id) == ["start", "cancelled"]


def listening(db: Database, worker_name: str) -> bool:
    """Whether the worker's LISTEN connection is up (pg_stat_activity shows its last statement)."""
    from sqlalchemy import text

    query = text("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND application_name = :name")
    with db.engine.connect() as conn:
        return bool(conn.execute(query, {"name": f"sqla-jobs worker {worker_name}"[:63]}).scalar())


def test_on_postgresql_the_request_arrives_before_the_next_heartbeat(pg: Database) -> None:
    """PostgreSQL: the cancel NOTIFYs, so a listening worker asks at once instead of at its next
    heartbeat (20 s away with the default 60 s lease)."""
    job_id = enqueue(pg, "cooperative", payload={"mode": "return"})
    worker = Worker(pg.engine, queue, concurrency=2, poll_interval=30.0)  # neither polling nor heartbeats help
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        _wait_for(lambda: effects(pg, job_id) == ["start"])
        _wait_for(lambda: listening(pg, worker.name))  # its LISTEN is up (its first look is behind us)
        time.sleep(0.5)
        started = time.monotonic()
        cancel(pg, job_id)
        _wait_for(lambda: job_row(pg, job_id).state == "cancelled", timeout=15)
        # The notification, not a heartbeat (20 s away) or a poll (30 s): a bound with room for a loaded machine.
        assert time.monotonic() - started < 10
    finally:
        worker.stop()
        thread.join(60)
