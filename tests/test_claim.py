"""Claiming: which due job goes first, and a batch claim takes exactly what it asked for."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timedelta, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from sqla_jobs.drivers.base import Claimed
from tests import app
from tests.conftest import Database
from tests.helpers import count, enqueue


def claim(db: Database, limit: int, queues: list[str] | None = None) -> list[Claimed]:
    sql = app.queue.driver(db.engine)
    with sql.write(db.engine) as conn:
        return sql.claim(conn, limit, "test-worker", uuid.uuid4().hex, 60.0, queues)


def test_oldest_due_job_first(db: Database) -> None:
    past = datetime.now(timezone.utc) - timedelta(hours=1)
    newer = enqueue(db.engine, "noop", run_at=past + timedelta(minutes=10))
    older = enqueue(db.engine, "noop", run_at=past)
    assert [j.id for j in claim(db, 1)] == [older]
    assert [j.id for j in claim(db, 1)] == [newer]
    assert claim(db, 1) == []


def test_same_run_at_goes_by_id(db: Database) -> None:
    at = datetime.now(timezone.utc) - timedelta(minutes=1)
    ids = [enqueue(db.engine, "noop", run_at=at) for _ in range(3)]
    assert [j.id for j in claim(db, 3)] == ids


def test_higher_priority_first(db: Database) -> None:
    past = datetime.now(timezone.utc) - timedelta(hours=1)
    low_old = enqueue(db.engine, "noop", run_at=past)
    high_new = enqueue(db.engine, "noop", priority=10, run_at=past + timedelta(minutes=30))
    negative = enqueue(db.engine, "noop", priority=-5, run_at=past - timedelta(hours=1))
    assert [j.id for j in claim(db, 3)] == [high_new, low_old, negative]


def test_future_run_at_is_not_claimed(db: Database) -> None:
    enqueue(db.engine, "noop", run_at=datetime.now(timezone.utc) + timedelta(minutes=5))
    assert claim(db, 10) == []
    assert count(db.engine, app.Job, app.Job.state == "pending") == 1


def test_attempts_are_charged_at_claim(db: Database) -> None:
    job_id = enqueue(db.engine, "noop", max_attempts=3)
    [claimed] = claim(db, 1)
    assert (claimed.id, claimed.attempt, claimed.max_attempts) == (job_id, 1, 3)
    with Session(db.engine) as session:
        row = session.get(app.Job, job_id)
        assert row is not None
        assert (row.state, row.attempts, row.locked_by) == ("running", 1, "test-worker")
        assert row.locked_at is not None and row.lease_expires_at is not None and row.claim_token == claimed.token


def test_only_the_named_queues(db: Database) -> None:
    mail = enqueue(db.engine, "noop", queue="mail")
    enqueue(db.engine, "noop", queue="reports")
    assert [j.id for j in claim(db, 10, ["mail"])] == [mail]
    assert count(db.engine, app.Job, app.Job.queue == "reports", app.Job.state == "pending") == 1


def test_batch_claim_never_over_claims(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={}) for _ in range(50)])
    for limit, total in ((7, 7), (1, 8), (30, 38), (30, 50)):
        got = claim(db, limit)
        assert len(got) <= limit
        assert len({j.id for j in got}) == len(got)
        assert count(db.engine, app.Job, app.Job.state == "running") == total


def test_concurrent_claimers_never_over_claim_or_share(pg: Database) -> None:
    app.queue.create_tables(pg.engine)
    with Session(pg.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={}) for _ in range(400)])
    results: list[list[Claimed]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def claimer() -> None:
        start.wait()
        while True:  # until nothing is left to take (SKIP LOCKED never waits for the others)
            got = claim(pg, 5)
            with lock:
                results.append(got)
            if not got:
                return

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(r) <= 5 for r in results)
    ids = [j.id for r in results for j in r]
    assert len(ids) == len(set(ids)) == 400  # every job claimed, none twice
    with Session(pg.engine) as session:
        running = session.scalars(select(app.Job.id).where(app.Job.state == "running")).all()
    assert sorted(running) == sorted(ids)
