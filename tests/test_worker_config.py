"""A worker's settings are checked in one place, whichever way they come (Python, the CLI), and a Python
caller whose engine pool is too small for its concurrency is told so."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from sqla_jobs import ConfigError, Worker
from tests import app
from tests.conftest import Database, run_cli
from tests.helpers import count, enqueue, run_burst
from tests.test_cli import APP, clean_env


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("lease", -1.0, "lease must be > 0 seconds, got -1.0"),
    ("poll_interval", 0.0, "poll_interval must be > 0 seconds, got 0.0"),
    ("grace", -5.0, "grace must be >= 0 seconds, got -5.0"),
    ("batch_size", 0, "batch_size must be at least 1, got 0"),
    ("concurrency", 0, "concurrency must be at least 1, got 0"),
    ("heartbeat", 30.0, "heartbeat (30.0s) must be > 0 and at most lease / 3 (20s)"),
    ("prune_after", -1.0, "prune_after must be >= 0 seconds"),
    ("vacuum_dead_rows", 0,
     "vacuum_dead_rows must be a whole number >= 1 (or None to leave vacuuming to autovacuum), got 0"),
    ("vacuum_dead_rows", 2.5, "vacuum_dead_rows must be a whole number >= 1"),
])
def test_a_bad_setting_is_named_with_its_value(db: Database, setting: str, value: float, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Worker(db.engine, app.queue, **{setting: value})
    assert message in str(raised.value)


def test_the_cli_names_the_wrong_value() -> None:
    result = run_cli("worker", "--lease", "-1", "--url", "sqlite:///x.db", *APP, env=clean_env())
    assert result.returncode == 2
    # The parser refuses it first, naming the option and the value it got, and nothing else.
    assert "argument --lease: must be > 0, got -1" in result.stderr and "batch_size" not in result.stderr


def test_a_pool_too_small_for_the_concurrency_is_reported(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    small = create_engine(db.url, pool_size=2, max_overflow=0)
    try:
        with caplog.at_level(logging.WARNING, logger="sqla_jobs.worker"):
            Worker(small, app.queue, concurrency=8)
        [warning] = [r.getMessage() for r in caplog.records if "pool" in r.getMessage()]
        assert "holds at most 2 connections" in warning and "pool_size=10" in warning
    finally:
        small.dispose()


def test_a_pool_that_fits_is_not_reported(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    fits = create_engine(db.url, pool_size=10, max_overflow=0)
    try:
        with caplog.at_level(logging.WARNING, logger="sqla_jobs.worker"):
            ids = [enqueue(fits, "noop") for _ in range(3)]
            run_burst(fits, concurrency=8)
        assert not [r for r in caplog.records if "pool" in r.getMessage()]
        assert count(fits, app.Job, app.Job.id.in_(ids), app.Job.state == "finished") == 3
    finally:
        fits.dispose()


def test_prune_after_zero_deletes_finished_jobs_and_keeps_every_other_outcome(db: Database) -> None:
    """``prune_after=0``: the worker holds a discarding copy of the driver (the app's is unchanged) and
    names the setting in its start line; successes (plain, with a result, transactional with and without
    one, after a retry) leave no row, while a cancelled job stays ``cancelled`` and one that failed for
    good is dead-lettered."""
    assert Worker(db.engine, app.queue, prune_after=0).driver.discard_finished
    assert not Worker(db.engine, app.queue, prune_after=60).driver.discard_finished
    assert not app.queue.driver(db.engine).discard_finished
    assert "finished jobs deleted as they finish" in Worker(db.engine, app.queue, prune_after=0).config.summary()
    assert "deleted" not in Worker(db.engine, app.queue).config.summary()
    succeeding = [enqueue(db.engine, "noop"), enqueue(db.engine, "result_value", {"value": 42}),
                  enqueue(db.engine, "once"), enqueue(db.engine, "result_tx"),
                  enqueue(db.engine, "flaky", {"succeed_on": 2})]
    cancelled = enqueue(db.engine, "cancel")
    failing = enqueue(db.engine, "fail", max_attempts=1)
    run_burst(db.engine, prune_after=0)  # the test app retries at once (Backoff(base=0))
    assert count(db.engine, app.Job, app.Job.id.in_(succeeding)) == 0
    assert count(db.engine, app.Once) == 2  # the transactional handlers' writes committed with their deletes
    assert count(db.engine, app.Job, app.Job.id == cancelled, app.Job.state == "cancelled") == 1
    assert count(db.engine, app.DeadJob, app.DeadJob.id == failing) == 1
    assert count(db.engine, app.Job) == 1  # the cancelled job alone (pruned later, as before)


@pytest.mark.parametrize(("batch_size", "claims"), [(None, 1), (40, 4)], ids=["default", "capped"])
def test_a_claim_takes_a_job_for_every_free_thread_unless_batch_size_caps_it(
        db: Database, batch_size: int | None, claims: int) -> None:
    """``batch_size`` defaults to the concurrency: 150 idle threads take 150 waiting jobs in one claim (one
    claim token on every row); capped at 40, the same jobs take four claims (40 + 40 + 40 + 30)."""
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={}) for _ in range(150)])
    worker = run_burst(db.engine, concurrency=150, batch_size=batch_size)
    assert worker.batch_size == (batch_size or 150)
    with Session(db.engine) as session:
        tokens = Counter(session.scalars(select(app.Job.claim_token).where(app.Job.state == "finished")))
    assert sum(tokens.values()) == 150
    assert len(tokens) == claims, tokens
