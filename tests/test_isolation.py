"""The claim rule for jobs marked ``isolate`` (their worker process was lost while they ran).

A busy worker's claim leaves them and says one is waiting; an idle worker's
claim (``alone``) takes the most urgent one and nothing else; the mark is
cleared when the run ends and kept when a shutdown hands the job back. The
ordinary claim keeps its plan on the partial pending index. Workers and the
supervisor are tested end to end in tests/reliability/test_poison.py.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import text, update
from sqlalchemy.orm import Session

from sqla_jobs.worker.outcomes import hand_back_lost, hand_back_unfinished
from tests import app
from tests.conftest import Database
from tests.helpers import enqueue, job


def mark(db: Database, *ids: int) -> None:
    with db.engine.begin() as conn:
        conn.execute(update(app.Job.__table__).where(app.Job.id.in_(ids)).values(isolate=True))


def claim(db: Database, limit: int, *, alone: bool, fences: list[tuple[int, str]] | None = None) -> Any:
    sql = app.queue.driver(db.engine)
    with sql.write(db.engine) as conn:
        return sql.finish_and_claim(conn, fences or [], limit, "w", uuid.uuid4().hex, 60.0, None, alone=alone)


def test_new_jobs_are_not_isolated(db: Database) -> None:
    job_id = enqueue(db.engine, "noop")
    row = job(db.engine, job_id)
    assert row is not None and row.isolate is False
    _, [claimed], waiting = claim(db, 1, alone=True)
    assert (claimed.id, claimed.isolated, waiting) == (job_id, False, False)


def test_a_busy_claim_leaves_isolated_jobs_and_says_so(db: Database) -> None:
    past = datetime.now(timezone.utc) - timedelta(minutes=5)
    first, second, third = (enqueue(db.engine, "noop", run_at=past + timedelta(seconds=i)) for i in range(3))
    mark(db, second)
    _, claimed, waiting = claim(db, 3, alone=False)
    assert sorted(j.id for j in claimed) == [first, third]  # the worker's claim need not come sorted
    assert waiting is True
    row = job(db.engine, second)
    assert row is not None and (row.state, row.attempts) == ("pending", 0)
    assert claim(db, 3, alone=False)[1:] == ([], True)  # `second`, the only due job, is left again
    _, [taken], waiting = claim(db, 3, alone=True)
    assert (taken.id, taken.isolated, waiting) == (second, True, False)


def test_an_idle_claim_takes_the_most_urgent_isolated_job_and_nothing_else(db: Database) -> None:
    past = datetime.now(timezone.utc) - timedelta(minutes=5)
    ordinary = enqueue(db.engine, "noop", run_at=past)
    later = enqueue(db.engine, "noop", run_at=past + timedelta(seconds=2))
    urgent = enqueue(db.engine, "noop", run_at=past + timedelta(seconds=1), priority=5)
    mark(db, later, urgent)
    _, [taken], waiting = claim(db, 10, alone=True)
    assert (taken.id, taken.isolated) == (urgent, True)
    assert waiting is True, "the other isolated job is still waiting"
    _, [second], waiting = claim(db, 10, alone=True)
    assert (second.id, waiting) == (later, False)
    _, rest, waiting = claim(db, 10, alone=True)
    assert ([j.id for j in rest], waiting) == ([ordinary], False)


def test_the_mark_is_cleared_when_the_run_ends_and_kept_on_a_give_back(db: Database) -> None:
    sql = app.queue.driver(db.engine)
    retried, given_back = enqueue(db.engine, "noop"), enqueue(db.engine, "noop")
    mark(db, retried, given_back)
    _, [a], _ = claim(db, 1, alone=True)
    _, [b], _ = claim(db, 1, alone=True)
    assert {a.id, b.id} == {retried, given_back}
    by_id = {a.id: a, b.id: b}
    with sql.write(db.engine) as conn:
        assert sql.release(conn, by_id[retried].fence, error="ValueError: boom", attempt=1)
        assert hand_back_unfinished(sql, conn, [by_id[given_back].fence]) == 1
    assert job(db.engine, retried).isolate is False  # type: ignore[union-attr]
    assert job(db.engine, given_back).isolate is True, "a shutdown interrupted the run, it did not end it"  # type: ignore[union-attr]


def test_the_reaper_marks_lost_jobs(db: Database) -> None:
    sql = app.queue.driver(db.engine)
    job_id = enqueue(db.engine, "noop")
    assert len(claim(db, 1, alone=False)[1]) == 1
    held = lambda conn: sql.held_by(conn, "w")  # noqa: E731
    assert hand_back_lost(app.queue, db.engine, sql, held, "worker {row.locked_by} died") == 1
    row = job(db.engine, job_id)
    assert row is not None and (row.state, row.isolate, row.attempts) == ("pending", True, 1)
    assert row.errors[-1]["error"] == "WorkerLost: worker w died during attempt 1"
    assert claim(db, 1, alone=False)[1:] == ([], True)


def test_the_ordinary_claim_keeps_its_index_plan(pg: Database) -> None:
    """The hot statement still reads ix_jobs_pending, in order, with isolated jobs among the due ones."""
    app.queue.create_tables(pg.engine)
    with Session(pg.engine) as session, session.begin():
        app.queue.enqueue_many(session, [{"kind": "noop"} for _ in range(20_000)])
    mark(pg, 5, 7)
    sql = app.queue.driver(pg.engine)
    with pg.engine.connect() as conn:
        conn.execute(text("ANALYZE jobs"))
        params = {"fences": "", "limit": 4, "worker": "w", "token": "t", "lease": 60.0, "queues": [],
                  "alone": False}
        with conn.connection.driver_connection.cursor() as cursor:  # type: ignore[union-attr]
            cursor.execute("EXPLAIN " + sql._pg_hot[False, False, False, False, False], params)
            plan = "\n".join(r[0] for r in cursor.fetchall())
    assert "ix_jobs_pending" in plan, plan
    assert "Seq Scan on jobs" not in plan, plan
