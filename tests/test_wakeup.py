"""How an idle worker learns about new jobs: NOTIFY from a trigger on PostgreSQL, polling everywhere.

The workers here poll only every 30 s, so a job picked up within a few
seconds proves a notification woke the worker (no timing claims beyond that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from sqla_jobs import Worker
from tests import app
from tests.conftest import Database
from tests.helpers import count


@contextmanager
def idle_worker(db: Database, **options: object) -> Iterator[Worker]:
    worker = Worker(db.engine, app.queue, concurrency=2, **options)  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    time.sleep(1.0)  # past its first look at the table: from now on it sleeps
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)


def finished_within(db: Database, n: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if count(db.engine, app.Job, app.Job.state == "finished") >= n:
            return True
        time.sleep(0.05)
    return False


def test_inserts_of_every_kind_wake_an_idle_worker(pg: Database) -> None:
    app.queue.create_tables(pg.engine)
    with idle_worker(pg, poll_interval=30.0):
        with Session(pg.engine) as session, session.begin():
            session.add(app.Job(kind="noop", payload={}))
        assert finished_within(pg, 1, 5), "session.add did not wake the worker"
        with Session(pg.engine) as session, session.begin():
            app.queue.enqueue_many(session, [{"kind": "noop"}, {"kind": "noop"}])
        assert finished_within(pg, 3, 5), "enqueue_many (COPY) did not wake the worker"
        with pg.engine.begin() as conn:  # another program, plain SQL
            conn.execute(text("INSERT INTO jobs (kind, payload) VALUES ('noop', '{}')"))
        assert finished_within(pg, 4, 5), "a plain INSERT did not wake the worker"


def test_without_listen_the_worker_polls(db: Database) -> None:
    with idle_worker(db, poll_interval=0.2, listen=False):
        with Session(db.engine) as session, session.begin():
            session.add(app.Job(kind="noop", payload={}))
        assert finished_within(db, 1, 10)


def test_create_tables_adds_a_missing_trigger_and_the_worker_says_when_it_is_missing(
    pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    app.queue.create_tables(pg.engine)
    sql = app.queue.driver(pg.engine)
    with pg.engine.begin() as conn:
        conn.execute(text("DROP TRIGGER jobs_notify ON jobs"))
        assert not sql.has_notify_trigger(conn)
    with caplog.at_level(logging.WARNING, logger="sqla_jobs"):
        Worker(pg.engine, app.queue).run(burst=True, install_signals=False)
    assert "has no NOTIFY trigger" in caplog.text
    app.queue.create_tables(pg.engine)  # repairs it, changes nothing else
    with pg.engine.connect() as conn:
        assert sql.has_notify_trigger(conn)
