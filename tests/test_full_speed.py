"""The guarantees hold at benchmark speed: several worker processes, many threads, batched claims.

Each job of kind ``record`` writes a start and a finish row to ``effects``;
with 3 processes of 16 threads draining thousands of jobs through the batched
finish-and-claim path, every job must run exactly once and end finished.
"""

from __future__ import annotations

import sys

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import JobQueue
from tests import app, forkserver
from tests.conftest import ROOT, Database, run_cli
from tests.helpers import enqueue, job

JOBS = 3000


def test_every_job_runs_once_at_full_speed(db: Database) -> None:
    queue: JobQueue[app.Job, app.DeadJob] = app.queue
    with Session(db.engine) as session, session.begin():
        queue.enqueue_many(session, ({"kind": "record", "payload": {"n": i}} for i in range(JOBS)))
    command = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "worker", "--burst",
               "--app", "tests.app:queue", "--concurrency", "16", "--processes", "3", "--poll-interval", "0.05"]
    result = forkserver.run(command, env=db.env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr

    with Session(db.engine) as session:
        states = dict(session.execute(select(app.Job.state, func.count()).group_by(app.Job.state)).all())
        assert states == {"finished": JOBS}
        retried = session.execute(
            select(app.Job.id, app.Job.attempts, app.Job.errors).where(app.Job.attempts > 1)
        ).all()
        assert not retried, f"jobs ran more than one attempt: {retried}\n{result.stderr[-3000:]}"
        per_job = (
            select(app.Effect.job_id, app.Effect.event, func.count().label("n"))
            .group_by(app.Effect.job_id, app.Effect.event)
            .subquery()
        )
        runs = dict(session.execute(select(per_job.c.event, func.max(per_job.c.n)).group_by(per_job.c.event)).all())
        assert runs == {"start": 1, "finish": 1}, "some job ran more than once"
        assert session.scalar(select(func.count(func.distinct(app.Effect.job_id)))) == JOBS
        workers = session.scalar(select(func.count(func.distinct(app.Job.locked_by))))
        assert workers is not None and workers >= 2, "the processes did not share the work"


@pytest.mark.parametrize("options", [[], ["--processes", "2"], ["--async"]], ids=["one", "supervised", "async"])
def test_a_worker_process_leaves_its_start_up_heap_out_of_the_collectors_rounds(
        db: Database, options: list[str]) -> None:
    """``sqla-jobs worker`` freezes what start-up built (``freeze_startup_heap``): the collector's rounds over it
    were about a fifth of a worker's CPU on short jobs (docs/performance.md). A handler in the worker process itself
    asks whether the collector still sees the app's queue object."""
    asked = enqueue(db.engine, "heap")
    result = run_cli("worker", "--burst", "--app", "tests.app:queue", *options, env=db.env())
    assert result.returncode == 0, result.stderr
    row = job(db.engine, asked)
    assert row is not None and row.state == "finished", result.stderr
    assert row.result == {"queue_scanned": False}
