"""Durable sleeps and event waits across a PostgreSQL server restart and a worker restart (issue 34, points 2, 7).

Jobs parked in a sleep or in a wait for an event hold no connection and no thread; their state is rows
(the job ``pending`` with its due time, the step that parked it). A server restart while they are parked
must change nothing, nor must new worker processes: after them the sleepers resume at their due time, an event
emitted after the restarts wakes its waiters, each step ran exactly once, and no attempt was charged.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from sqlalchemy.orm import Session

from tests import app, durable_app  # noqa: F401 - registers the durable handlers the jobs name
from tests.conftest import Database

from .cluster import PrivateCluster
from .conftest import Workers
from .harness import all_settled, effects, enqueue, job, wait_for

pytestmark = pytest.mark.slow

SLEEP_SECONDS = 5.0


def _parked(db: Database, ids: list[int]) -> bool:
    """Each job has run its first step and parked: pending, its ``before`` step recorded."""
    before = {e.job_id for e in effects(db.engine, event="step-before")}
    return set(ids) <= before and all(job(db.engine, i).state == "pending" for i in ids)


def test_sleeps_and_event_waits_resume_once_after_a_server_and_a_worker_restart(
    private_cluster: PrivateCluster, private_db: Database, workers: Workers
) -> None:
    engine = private_db.engine
    enqueued = time.time()
    sleepers = enqueue(engine, "d_sleep", {"seconds": SLEEP_SECONDS}, n=4)
    waiters = enqueue(engine, "d_wait", {"key": "paid:restart"}, n=4)
    pool = [workers(private_db.url, concurrency=2, app="tests.durable_app:queue") for _ in range(2)]
    wait_for(lambda: _parked(private_db, sleepers + waiters), 60, "every job to park")
    # Both started: one may have parked every job while the other still started, and a worker that cannot reach
    # its database while it starts exits 1 (by design), which is not what this test is about.
    wait_for(lambda: all(w.started() for w in pool), 60, "every worker to start")
    private_cluster.stop("fast")  # every connection of the workers is cut; nothing is running
    time.sleep(2)
    private_cluster.start()
    wait_for(lambda: all("database is back" in w.log() for w in pool), 60, "the workers to reconnect")
    for worker in pool:  # and the workers restart too: the parked jobs are rows, not anything a process holds
        assert worker.alive(), "a worker died instead of reconnecting"
        assert worker.stop() == 0
    pool = [workers(private_db.url, concurrency=2, app="tests.durable_app:queue") for _ in range(2)]
    with Session(engine) as session, session.begin():
        app.queue.emit_event(session, "paid:restart", {"amount": 42})
    wait_for(lambda: all_settled(engine, sleepers + waiters), 90, "every job to finish after the restarts")
    for worker in pool:
        assert worker.alive()
        assert worker.stop() == 0
    steps = Counter((e.job_id, e.event) for e in effects(engine))
    for job_id in sleepers + waiters:
        row = job(engine, job_id)
        assert row.state == "finished" and row.attempts == 1, (job_id, row.state, row.attempts, row.last_error)
        assert steps[(job_id, "step-before")] == 1 and steps[(job_id, "step-after")] == 1, steps
    for job_id in sleepers:
        row = job(engine, job_id)
        assert row.result == "woke"
        assert row.finished_at.timestamp() >= enqueued + SLEEP_SECONDS - 1  # resumed at its due time, not before
    for job_id in waiters:
        assert job(engine, job_id).result == {"data": {"amount": 42}}
