"""Small helpers shared by the behaviour tests: enqueue, run a worker in-process, read rows back."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from sqla_jobs import JobQueue, Worker
from tests import app


def enqueue(engine: Engine, kind: str, payload: dict[str, Any] | None = None, **fields: Any) -> int:
    """Commit one job and return its id."""
    with Session(engine) as session, session.begin():
        job = app.Job(kind=kind, payload=payload or {}, **fields)
        session.add(job)
        session.flush()
        return job.id


def run_burst(engine: Engine, queue: JobQueue[Any, Any] | None = None, **options: Any) -> Worker:
    """Run a worker in this process until no job is due; returns it (``processed`` counts outcomes)."""
    options.setdefault("concurrency", 2)
    options.setdefault("poll_interval", 0.05)
    worker = Worker(engine, queue or app.queue, **options)
    assert worker.run(burst=True, install_signals=False) == 0
    return worker


def job(engine: Engine, job_id: int) -> app.Job | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(app.Job, job_id)


def dead(engine: Engine, job_id: int) -> app.DeadJob | None:
    with Session(engine, expire_on_commit=False) as session:
        return session.get(app.DeadJob, job_id)


def count(engine: Engine, model: Any, *where: Any) -> int:
    with Session(engine) as session:
        return session.scalar(select(func.count()).select_from(model).where(*where)) or 0


def effects(engine: Engine, job_id: int | None = None) -> list[tuple[int, int, str]]:
    """(job_id, attempt, event) rows, in insertion order."""
    stmt = select(app.Effect.job_id, app.Effect.attempt, app.Effect.event).order_by(app.Effect.id)
    if job_id is not None:
        stmt = stmt.where(app.Effect.job_id == job_id)
    with Session(engine) as session:
        return [tuple(row) for row in session.execute(stmt)]  # type: ignore[misc]


def db_now(engine: Engine) -> datetime:
    """The database clock, as an aware UTC datetime (the clock the worker schedules with)."""
    with engine.connect() as conn:
        return utc(conn.scalar(select(app.queue.driver(conn).now())))


def utc(value: datetime | None) -> datetime:
    """SQLite hands datetimes back naive (they are stored as UTC); make every value comparable."""
    assert value is not None
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def mixed_graph(engine: Engine) -> dict[str, int]:
    """A graph with every kind of neighbour, after a worker's burst; the jobs' ids by name.

    ``join`` depends on ``ok`` (finished, then pruned: gone), ``bad`` (dead-lettered, counted as done:
    ``on_upstream_failure="run"``) and ``later`` (pending, due tomorrow), so it is blocked on one; ``waiter``
    waits for ``bad``'s requeue (``"wait"``); ``after`` depends on ``join``.
    """
    tomorrow = datetime.now(timezone.utc) + timedelta(days=1)
    with Session(engine, expire_on_commit=False) as session, session.begin():
        jobs = {"ok": app.Job(kind="noop", payload={}), "bad": app.Job(kind="fail", payload={}, max_attempts=1),
                "later": app.Job(kind="noop", payload={}, run_at=tomorrow)}
        jobs["join"] = app.Job(kind="join", payload={}, depends_on=[jobs["ok"], jobs["bad"], jobs["later"]],
                               on_upstream_failure="run")
        jobs["waiter"] = app.Job(kind="noop", payload={}, depends_on=[jobs["bad"]], on_upstream_failure="wait")
        jobs["after"] = app.Job(kind="noop", payload={}, depends_on=[jobs["join"]])
        session.add_all(jobs.values())
    run_burst(engine)
    assert app.queue.prune(engine, older_than=0) == 1  # `ok`, finished
    return {name: job.id for name, job in jobs.items()}
