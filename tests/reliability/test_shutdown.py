"""Graceful shutdown: SIGTERM with a short job, with a job longer than the grace period, a second signal."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.conftest import Database

from .conftest import Workers
from .harness import all_settled, check_invariants, effects, enqueue, job, wait_for

pytestmark = pytest.mark.slow


def test_sigterm_lets_a_short_job_finish_and_exits_0(db: Database, workers: Workers) -> None:
    [job_id] = enqueue(db.engine, "sleep", {"seconds": 1.0})
    worker = workers(db.url, grace=10)
    wait_for(lambda: effects(db.engine, job_id, "start"), 30, "the handler to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(15) == 0
    check_invariants(db.engine, [job_id], workers.logs())
    row = job(db.engine, job_id)
    assert (row.state, row.attempts) == ("finished", 1)
    assert "shutting down gracefully" in worker.log()


def test_sigterm_gives_back_a_job_longer_than_the_grace_period(db: Database, workers: Workers) -> None:
    # A 60 s lease: if the job came back through lease expiry instead, the second worker would wait a minute.
    [job_id] = enqueue(db.engine, "sleep", {"seconds": 4.0})
    worker = workers(db.url, grace=0.5, lease=60, heartbeat=20)
    wait_for(lambda: effects(db.engine, job_id, "start"), 30, "the handler to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(10) == 0
    assert "gave 1 running job(s) back" in worker.log()
    row = job(db.engine, job_id)
    assert (row.state, row.attempts, row.claim_token) == ("pending", 0, None), "given back, attempt refunded"
    check_invariants(db.engine, [job_id])

    workers(db.url, lease=60, heartbeat=20)
    wait_for(lambda: all_settled(db.engine, [job_id]), 15, "the given-back job to run again promptly")
    check_invariants(db.engine, [job_id], workers.logs())
    assert job(db.engine, job_id).attempts == 1
    assert [e.event for e in effects(db.engine, job_id)] == ["start", "start", "finish"]


def test_sigterm_with_a_transactional_job(db: Database, workers: Workers, tmp_path: Path) -> None:
    """PostgreSQL: given back after the grace period, its uncommitted write rolled back, run again later.

    SQLite: the handler's transaction holds the write lock, so the give-back waits for it and the job
    finishes in that run (the grace period is stretched, nothing is lost or doubled).
    """
    marker = tmp_path / "started"
    [job_id] = enqueue(db.engine, "once_slow", {"marker": str(marker), "sleep": 3.0})
    worker = workers(db.url, grace=0.5, lease=60, heartbeat=20)
    wait_for(lambda: Path(f"{marker}.1").exists(), 30, "the handler to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(40) == 0
    check_invariants(db.engine, [job_id], workers.logs())  # Once row if and only if finished
    if db.backend == "sqlite":
        assert job(db.engine, job_id).state == "finished"
        return
    assert job(db.engine, job_id).state == "pending"
    workers(db.url, lease=60, heartbeat=20)
    wait_for(lambda: all_settled(db.engine, [job_id]), 20, "the given-back job to run again")
    check_invariants(db.engine, [job_id], workers.logs())  # exactly one Once row


def test_second_signal_exits_at_once_and_the_lease_covers_the_job(db: Database, workers: Workers) -> None:
    [job_id] = enqueue(db.engine, "sleep", {"seconds": 30.0})
    worker = workers(db.url, grace=60)
    wait_for(lambda: effects(db.engine, job_id, "start"), 30, "the handler to start")
    worker.signal(signal.SIGTERM)
    wait_for(lambda: "shutting down gracefully" in worker.log(), 10, "the first signal to be handled")
    sent = time.monotonic()
    worker.signal(signal.SIGINT)
    assert worker.wait(10) == 1
    assert time.monotonic() - sent < 5, "the second signal must not wait for the grace period"
    assert job(db.engine, job_id).state == "running"
    check_invariants(db.engine, [job_id])  # still under its live lease

    # The lease, not the dead worker, decides: another worker takes the job over once it runs out.
    workers(db.url)
    wait_for(lambda: job(db.engine, job_id).attempts == 2, 30, "the job to be taken over after the lease")
    check_invariants(db.engine, [job_id], workers.logs())
