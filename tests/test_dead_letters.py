"""Requeueing dead jobs from Python: by id, by kind, everything; history kept; the job runs again."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from sqla_jobs import ConfigError, NotFound
from tests import app
from tests.conftest import Database
from tests.helpers import count, dead, effects, enqueue, job, run_burst


def kill(db: Database, kind: str = "fail", n: int = 1, **payload: str) -> list[int]:
    """Enqueue ``n`` jobs that fail for good, run them into the dead-letter table, return their ids."""
    ids = [enqueue(db.engine, kind, dict(payload), max_attempts=2) for _ in range(n)]
    run_burst(db.engine)
    assert count(db.engine, app.DeadJob, app.DeadJob.id.in_(ids)) == n
    return ids


def requeue(db: Database, **how: object) -> list[int]:
    with Session(db.engine) as session, session.begin():
        return app.queue.requeue_dead(session, **how)  # type: ignore[arg-type]


def test_requeue_one_by_id_resets_attempts_and_keeps_history(db: Database) -> None:
    first, second = kill(db, n=2, message="disk full")
    assert requeue(db, ids=[first]) == [first]
    row = job(db.engine, first)
    assert row is not None
    assert (row.state, row.attempts, row.max_attempts, row.kind) == ("pending", 0, 2, "fail")
    assert row.payload == {"message": "disk full"}
    assert row.last_error is not None
    assert row.last_error.startswith("ValueError: disk full\n[requeued from the dead-letter table at ")
    assert [e["attempt"] for e in row.errors or []] == [1, 2, None]  # the requeue is in the history too
    assert (row.errors or [])[-1]["error"] == "requeued from the dead-letter table: attempts start again from 1"
    assert dead(db.engine, first) is None
    assert dead(db.engine, second) is not None  # the other one stays dead


def test_requeued_job_runs_again_and_history_grows(db: Database) -> None:
    [job_id] = kill(db, message="still broken")
    requeue(db, ids=[job_id])
    run_burst(db.engine)
    row = dead(db.engine, job_id)  # it failed twice more, so it is dead again, with all four failures
    assert row is not None and row.attempts == 2
    # ... and the requeue between them, so the second 1, 2 is not read as the first one twice
    assert [e["attempt"] for e in row.errors or []] == [1, 2, None, 1, 2]
    assert "requeued from the dead-letter table" in (row.errors or [])[2]["error"]


def test_requeued_job_can_succeed(db: Database) -> None:
    # A job that is dead because its dependency was down; now it works.
    with Session(db.engine) as session, session.begin():
        session.add(app.DeadJob(id=900, kind="record", payload={}, attempts=5, max_attempts=5,
                                last_error="ConnectionError: down", errors=[{"attempt": 5, "error": "down"}]))
    assert requeue(db, ids=[900]) == [900]
    run_burst(db.engine)
    assert effects(db.engine, 900) == [(900, 1, "start"), (900, 1, "finish")]
    row = job(db.engine, 900)
    assert row is not None and (row.state, row.attempts) == ("finished", 1)


def test_requeue_by_kind(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = kill(db, n=2)
    monkeypatch.setattr(app.queue, "check_kinds", False)
    other = kill(db, kind="gone_kind")
    assert requeue(db, kind="fail") == sorted(failed)
    assert count(db.engine, app.Job, app.Job.id.in_(failed), app.Job.state == "pending") == 2
    assert dead(db.engine, other[0]) is not None


def test_requeue_everything(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app.queue, "check_kinds", False)
    ids = kill(db, n=2) + kill(db, kind="gone_kind")
    assert requeue(db, everything=True) == sorted(ids)
    assert count(db.engine, app.DeadJob) == 0
    assert count(db.engine, app.Job, app.Job.state == "pending", app.Job.attempts == 0) == 3


def test_requeue_of_an_id_that_is_not_dead(db: Database) -> None:
    [dead_id] = kill(db)
    alive = enqueue(db.engine, "noop")
    with pytest.raises(NotFound, match=f"no dead job with id {alive}"):
        requeue(db, ids=[dead_id, alive])
    # The error rolled the whole transaction back: the dead one was not moved either.
    assert dead(db.engine, dead_id) is not None
    assert count(db.engine, app.Job, app.Job.id == dead_id) == 0


def test_requeue_needs_a_selection(db: Database) -> None:
    with pytest.raises(ConfigError, match="ids=, kind= or everything=True"):
        requeue(db)


def test_requeue_nothing_of_that_kind(db: Database) -> None:
    assert requeue(db, kind="nothing_dead") == []


def test_dead_letter_replaces_a_stale_dead_row_with_the_same_id(db: Database) -> None:
    """Reused ids (a SQLite table rebuilt without AUTOINCREMENT) must not wedge the worker."""
    from sqlalchemy import insert

    job_id = enqueue(db.engine, "fail", {"message": "new failure"}, max_attempts=1)
    with db.engine.begin() as conn:
        conn.execute(insert(app.DeadJob).values(id=job_id, kind="older_kind", payload={}, last_error="old failure"))
    run_burst(db.engine)
    with Session(db.engine) as session:
        row = session.get(app.DeadJob, job_id)
        assert row is not None and row.kind == "fail"
        assert row.last_error == "ValueError: new failure"
        assert row.errors is not None and "older_kind" in row.errors[0]["error"]
        assert "old failure" in row.errors[0]["error"]
