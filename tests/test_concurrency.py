"""Several worker processes on one database: every job runs exactly once (PostgreSQL and one SQLite file),
with the threaded worker and with the async one (``--async``, its handlers the ``async def`` twins)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tests import app, forkserver
from tests.conftest import ROOT, Database

pytestmark = pytest.mark.slow

ONCE_JOBS = 2000
RECORD_JOBS = 200
PROCESSES = 4


def _run_burst_workers(db: Database, flavour: str, *options: str) -> None:
    """PROCESSES ``sqla-jobs worker --burst`` processes at once, until the queue is empty; each must exit 0."""
    workers = [
        forkserver.Popen(
            [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "worker", "--burst",
             "--concurrency", "4", "--app", "tests.app:queue", *options, *(["--async"] if flavour == "async" else [])],
            env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err
        assert "Traceback" not in err, err


@pytest.mark.parametrize("flavour", ["threaded", "async"])
def test_four_worker_processes_run_every_job_exactly_once(db: Database, flavour: str) -> None:
    once, record = ("async_once", "async_record") if flavour == "async" else ("once", "record")
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind=once, payload={}) for _ in range(ONCE_JOBS)])
        session.add_all([app.Job(kind=record, payload={}) for _ in range(RECORD_JOBS)])
    _run_burst_workers(db, flavour)

    with Session(db.engine) as session:
        states = Counter(session.scalars(select(app.Job.state)))
        once_ids = set(session.scalars(select(app.Job.id).where(app.Job.kind == once)))
        record_ids = set(session.scalars(select(app.Job.id).where(app.Job.kind == record)))
        done = set(session.scalars(select(app.Once.job_id)))
        finishes = Counter(session.scalars(select(app.Effect.job_id).where(app.Effect.event == "finish")))
        pids = set(session.scalars(select(app.Effect.pid)))
        attempts = Counter(session.scalars(select(app.Job.attempts).where(app.Job.kind == once)))
    assert states == {"finished": ONCE_JOBS + RECORD_JOBS}
    # The transactional handler: the unique key on job id would have refused a second committed run.
    assert done == once_ids
    assert attempts == {1: ONCE_JOBS}  # and no run was ever rolled back and retried
    # The plain handler: its side effect (a row written outside the job's transaction) happened once per job.
    assert set(finishes) == record_ids
    assert set(finishes.values()) == {1}
    assert len(pids) >= 2, "the jobs were not shared between processes"


@pytest.mark.parametrize("flavour", ["threaded", "async"])
def test_workers_that_keep_no_finished_jobs_delete_each_once_after_its_one_run(db: Database, flavour: str) -> None:
    """``--prune-finished-older-than 0``: each finish deletes its job (Driver.discarding_finished), on the
    hot path (plain handlers) and inside a transactional handler's own transaction, across processes."""
    once, record = ("async_once", "async_record") if flavour == "async" else ("once", "record")
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind=once, payload={}) for _ in range(500)])
        session.add_all([app.Job(kind=record, payload={}) for _ in range(100)])
    with Session(db.engine) as session:
        once_ids = set(session.scalars(select(app.Job.id).where(app.Job.kind == once)))
        record_ids = set(session.scalars(select(app.Job.id).where(app.Job.kind == record)))
    _run_burst_workers(db, flavour, "--prune-finished-older-than", "0")

    with Session(db.engine) as session:
        left = Counter(session.scalars(select(app.Job.state)))
        dead = session.scalar(select(func.count()).select_from(app.DeadJob))
        done = Counter(session.scalars(select(app.Once.job_id)))
        finishes = Counter(session.scalars(select(app.Effect.job_id).where(app.Effect.event == "finish")))
    assert left == {} and dead == 0  # every job ran and none was kept, nor dead-lettered
    assert set(done) == once_ids and set(done.values()) == {1}
    assert set(finishes) == record_ids and set(finishes.values()) == {1}
