"""Crash recovery: SIGKILL mid-handler, the poison job, exactly-once rolled back by a crash, racing workers.

Each runs on a SQLite file (several processes on one file) and on PostgreSQL.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import Database

from .conftest import Workers
from .harness import all_settled, check_invariants, dead, effects, enqueue, job, wait_for

pytestmark = pytest.mark.slow


def test_sigkill_mid_handler_runs_again_after_the_lease(db: Database, workers: Workers) -> None:
    [job_id] = enqueue(db.engine, workers.kind("record"), {"sleep": 1.0})
    first = workers(db.url)
    wait_for(lambda: effects(db.engine, job_id, "start"), 30, "the handler to start")
    first.signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    assert job(db.engine, job_id).state == "running"  # nobody but the lease can free it

    workers(db.url)
    wait_for(lambda: all_settled(db.engine, [job_id]), 30, "the job to run again after its lease expired")
    check_invariants(db.engine, [job_id], workers.logs())
    row = job(db.engine, job_id)
    assert row.state == "finished"
    assert row.attempts == 2, "the lost attempt counts"
    assert "WorkerLost" in row.errors[0]["error"] and row.errors[0]["attempt"] == 1
    assert [(e.attempt, e.event) for e in effects(db.engine, job_id)] == [(1, "start"), (2, "start"), (2, "finish")]


def test_poison_job_ends_in_dead_letters_not_a_crash_loop(db: Database, workers: Workers) -> None:
    [job_id] = enqueue(db.engine, "suicide", max_attempts=3)
    started = 0
    while not dead(db.engine, job_id):
        assert started < 6, f"poison job still not dead-lettered after {started} workers"
        worker = workers(db.url)
        started += 1
        wait_for(lambda w=worker: not w.alive() or dead(db.engine, job_id), 30, "the worker to die or dead-letter")
    row = dead(db.engine, job_id)
    assert row.attempts == 3
    assert "WorkerLost" in row.last_error and "attempt 3" in row.last_error
    assert [e.attempt for e in effects(db.engine, job_id, "start")] == [1, 2, 3]
    assert started == 4, "three workers killed by the job, the fourth dead-letters it and lives"
    survivor = workers.started[-1]
    assert survivor.alive()
    assert survivor.stop() == 0
    check_invariants(db.engine, [job_id], workers.logs())


def test_crash_inside_a_transactional_handler_leaves_no_trace(db: Database, workers: Workers, tmp_path: Path) -> None:
    marker = tmp_path / "once-started"
    [job_id] = enqueue(db.engine, workers.kind("once_slow"), {"marker": str(marker), "sleep": 1.0})
    first = workers(db.url)
    wait_for(lambda: Path(f"{marker}.1").exists(), 30, "the transactional handler to flush its write")
    first.signal(signal.SIGKILL)
    first.wait(10)
    check_invariants(db.engine, [job_id])  # running under a live lease, and no Once row

    workers(db.url)
    wait_for(lambda: all_settled(db.engine, [job_id]), 30, "the job to run again")
    states = check_invariants(db.engine, [job_id], workers.logs())  # exactly one Once row
    assert states[job_id] == "finished"
    assert job(db.engine, job_id).attempts == 2
    assert Path(f"{marker}.2").exists()


def test_racing_workers_never_run_a_job_twice(db: Database, workers: Workers) -> None:
    pool = [workers(db.url, concurrency=2, poll_interval=0.05) for _ in range(3)]
    ids: list[int] = []
    for _ in range(12):  # one job at a time, so all idle workers race for each
        [one] = enqueue(db.engine, workers.kind("record"))
        ids.append(one)
        wait_for(lambda one=one: all_settled(db.engine, [one]), 30, "the job to finish")
    ids += enqueue(db.engine, workers.kind("record"), n=30)
    wait_for(lambda: all_settled(db.engine, ids), 60, "a batch of 30 to finish")
    for worker in pool:
        assert worker.stop() == 0
    check_invariants(db.engine, ids, workers.logs())
    starts = [e.job_id for e in effects(db.engine, event="start")]
    assert sorted(starts) == sorted(ids), "each job started exactly once"
