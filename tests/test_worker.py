"""The worker: outcomes, retries on the database clock, dead letters, hooks, handler controls."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from sqla_jobs import MAX_ERROR_LENGTH, Backoff, JobContext, JobEvent, JobQueue, current_job
from sqla_jobs.drivers import sqlite as sqlite_driver
from tests import app
from tests.conftest import Database
from tests.helpers import count, db_now, dead, effects, enqueue, job, run_burst, utc

# A second queue on the test app's tables, with real (slow) retry delays so a burst worker stops after
# one failure and the schedule can be read back. check_kinds=False: it must not veto app.queue's kinds.
slow: JobQueue[app.Job, app.DeadJob] = JobQueue(
    app.Job, app.DeadJob, backoff=Backoff(base=600, jitter=0), check_kinds=False
)
seen: list[JobContext] = []
events: list[JobEvent] = []


@slow.handler("fail")
def slow_fail(payload: dict[str, Any]) -> None:
    raise ValueError(payload.get("message", "boom"))


@slow.handler("socket_timeout")
def socket_timeout(payload: dict[str, Any]) -> None:
    raise TimeoutError("read timed out")  # what a socket raises: not the kind's own timeout (it has none)


@slow.handler("fail_fast_retry", backoff=Backoff(base=90, jitter=0))
def fail_fast_retry(payload: dict[str, Any]) -> None:
    raise ValueError("per-kind backoff")


@slow.handler("whoami")
def whoami(payload: dict[str, Any]) -> None:
    seen.append(current_job())


@slow.handler("tx_then_fail", transactional=True)
def tx_then_fail(payload: dict[str, Any]) -> None:
    session = current_job().session
    assert session is not None
    session.add(app.Once(job_id=current_job().id))
    session.flush()  # the row reached the database inside the job's transaction
    raise RuntimeError("after writing")


@slow.on("dead_letter")
@slow.on("finished")
@slow.on("failed")
def remember(event: JobEvent) -> None:
    events.append(event)


@slow.on("finished")
def broken_hook(event: JobEvent) -> None:
    raise RuntimeError("a metrics backend that is down")


@pytest.fixture(autouse=True)
def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kinds above belong to `slow`, not to app.queue, whose kind check would refuse them.
    monkeypatch.setattr(app.queue, "check_kinds", False)
    seen.clear()
    events.clear()


def test_success_sets_finished(db: Database) -> None:
    job_id = enqueue(db.engine, "noop")
    worker = run_burst(db.engine)
    row = job(db.engine, job_id)
    assert row is not None
    assert (row.state, row.attempts, row.last_error) == ("finished", 1, None)
    assert row.finished_at is not None and utc(row.finished_at) >= utc(row.locked_at)
    assert row.lease_expires_at is None
    assert worker.processed == 1


def test_failure_stores_error_and_retries_at_db_now_plus_backoff(db: Database) -> None:
    job_id = enqueue(db.engine, "fail", {"message": "smtp down"}, max_attempts=3)
    before = db_now(db.engine)
    run_burst(db.engine, slow)
    after = db_now(db.engine)
    row = job(db.engine, job_id)
    assert row is not None
    assert (row.state, row.attempts) == ("pending", 1)
    assert row.last_error == "ValueError: smtp down"
    assert row.errors is not None and [(e["attempt"], e["error"]) for e in row.errors] == [(1, "ValueError: smtp down")]
    tolerance = timedelta(seconds=2)
    assert before + timedelta(seconds=600) - tolerance <= utc(row.run_at) <= after + timedelta(seconds=600) + tolerance
    assert [e.name for e in events] == ["failed"]


def test_a_timeout_error_raised_by_the_handler_is_an_ordinary_failure(db: Database) -> None:
    # asyncio.TimeoutError is the built-in TimeoutError: it once took the worker's timeout path
    # (for a kind with no timeout) and crashed the handler thread instead of failing the job.
    job_id = enqueue(db.engine, "socket_timeout", max_attempts=3)
    worker = run_burst(db.engine, slow)
    row = job(db.engine, job_id)
    assert row is not None
    assert (row.state, row.attempts, row.last_error) == ("pending", 1, "TimeoutError: read timed out")
    assert worker.processed == 1 and [e.name for e in events] == ["failed"]


def test_per_kind_backoff_overrides_the_queue(db: Database) -> None:
    job_id = enqueue(db.engine, "fail_fast_retry", max_attempts=3)
    run_burst(db.engine, slow)
    now = db_now(db.engine)
    row = job(db.engine, job_id)
    assert row is not None and row.state == "pending"
    assert abs((utc(row.run_at) - now) - timedelta(seconds=90)) < timedelta(seconds=5)


def test_huge_error_is_truncated(db: Database) -> None:
    job_id = enqueue(db.engine, "fail", {"message": "x" * 200_000}, max_attempts=2)
    run_burst(db.engine, slow)
    row = job(db.engine, job_id)
    assert row is not None and row.last_error is not None and row.errors is not None
    assert MAX_ERROR_LENGTH - 20 <= len(row.last_error) <= MAX_ERROR_LENGTH
    assert row.last_error.startswith("ValueError: xxx") and row.last_error.endswith("[truncated]")
    assert row.errors[0]["error"] == row.last_error


def test_last_attempt_moves_the_job_to_dead_letters(db: Database) -> None:
    job_id = enqueue(db.engine, "fail", {"message": "bad address", "to": "x@example.com"}, max_attempts=3)
    run_burst(db.engine)  # the test app retries at once
    assert job(db.engine, job_id) is None
    row = dead(db.engine, job_id)
    assert row is not None
    assert (row.kind, row.attempts, row.max_attempts) == ("fail", 3, 3)
    assert row.payload == {"message": "bad address", "to": "x@example.com"}
    assert row.last_error == "ValueError: bad address"
    assert [e["attempt"] for e in row.errors or []] == [1, 2, 3]
    assert row.failed_at is not None and row.created_at is not None


def test_dead_letter_hook_fires_with_the_kind(db: Database) -> None:
    job_id = enqueue(db.engine, "fail", {"message": "nope"}, max_attempts=1)
    run_burst(db.engine, slow)
    assert [(e.name, e.id, e.kind, e.attempt) for e in events] == [("dead_letter", job_id, "fail", 1)]
    assert events[0].error == "ValueError: nope"
    assert dead(db.engine, job_id) is not None


def test_a_hook_that_raises_does_not_break_the_worker(db: Database) -> None:
    ids = [enqueue(db.engine, "whoami") for _ in range(3)]
    run_burst(db.engine, slow, concurrency=1)
    assert [e.id for e in events if e.name == "finished"] == ids  # the raising hook ran too, in between
    assert count(db.engine, app.Job, app.Job.state == "finished") == 3


def test_unknown_kind_fails_naming_the_kinds_then_dead_letters(db: Database) -> None:
    # check_kinds is off (fixture above): as if enqueued by a process that does not import the handlers.
    job_id = enqueue(db.engine, "sned_email", max_attempts=2)
    run_burst(db.engine)
    row = dead(db.engine, job_id)
    assert row is not None and row.attempts == 2
    assert row.last_error is not None
    assert "'sned_email'" in row.last_error
    assert "known kinds: " + ", ".join(sorted(app.queue.handlers)) in row.last_error
    assert [e["attempt"] for e in row.errors or []] == [1, 2]


def test_unknown_kind_is_retried_first(db: Database) -> None:
    job_id = enqueue(db.engine, "sned_email", max_attempts=4)
    run_burst(db.engine, slow)
    row = job(db.engine, job_id)
    assert row is not None and (row.state, row.attempts) == ("pending", 1)
    assert row.last_error is not None and row.last_error.startswith("UnknownKind: no handler for kind 'sned_email'")


def test_burst_with_nothing_due_returns_at_once(db: Database) -> None:
    worker = run_burst(db.engine)
    assert worker.processed == 0


def test_snooze_refunds_the_attempt(db: Database) -> None:
    job_id = enqueue(db.engine, "snooze", {"seconds": 300})
    run_burst(db.engine)
    now = db_now(db.engine)
    row = job(db.engine, job_id)
    assert row is not None
    assert (row.state, row.attempts, row.last_error) == ("pending", 0, None)
    assert abs((utc(row.run_at) - now) - timedelta(seconds=300)) < timedelta(seconds=5)


def test_cancel_stops_without_retry(db: Database) -> None:
    job_id = enqueue(db.engine, "cancel", max_attempts=5)
    run_burst(db.engine)
    row = job(db.engine, job_id)
    assert row is not None
    assert (row.state, row.attempts) == ("cancelled", 1)
    assert row.last_error == "JobCancel: customer deleted"
    assert row.finished_at is not None
    assert dead(db.engine, job_id) is None


def test_async_handler(db: Database) -> None:
    job_id = enqueue(db.engine, "async_noop")
    run_burst(db.engine)
    assert effects(db.engine, job_id) == [(job_id, 1, "finish")]
    row = job(db.engine, job_id)
    assert row is not None and row.state == "finished"


def test_current_job_gives_id_attempt_kind(db: Database) -> None:
    job_id = enqueue(db.engine, "whoami", {"k": "v"}, max_attempts=7, queue="q1")
    run_burst(db.engine, slow)
    [ctx] = seen
    assert (ctx.id, ctx.kind, ctx.attempt, ctx.max_attempts, ctx.queue, ctx.payload) == (
        job_id, "whoami", 1, 7, "q1", {"k": "v"}
    )
    assert ctx.session is None  # only transactional handlers get one


def test_current_job_outside_a_handler() -> None:
    with pytest.raises(LookupError, match="only available inside a job handler"):
        current_job()


def test_transactional_handler_commits_with_completion(db: Database) -> None:
    job_id = enqueue(db.engine, "once")
    run_burst(db.engine)
    row = job(db.engine, job_id)
    assert row is not None and row.state == "finished"
    assert count(db.engine, app.Once, app.Once.job_id == job_id) == 1


def test_transactional_handler_rolls_back_on_failure(db: Database) -> None:
    job_id = enqueue(db.engine, "tx_then_fail", max_attempts=2)
    run_burst(db.engine, slow)
    assert count(db.engine, app.Once) == 0
    row = job(db.engine, job_id)
    assert row is not None and (row.state, row.attempts) == ("pending", 1)
    assert row.last_error == "RuntimeError: after writing"


def test_flaky_job_succeeds_on_a_later_attempt(db: Database) -> None:
    job_id = enqueue(db.engine, "flaky", {"succeed_on": 3})
    run_burst(db.engine)
    row = job(db.engine, job_id)
    assert row is not None and (row.state, row.attempts) == ("finished", 3)
    assert [e["attempt"] for e in row.errors or []] == [1, 2]


def test_concurrency_runs_handlers_at_the_same_time(db: Database) -> None:
    ids = [enqueue(db.engine, "sleep", {"seconds": 1.0}) for _ in range(4)]
    run_burst(db.engine, concurrency=4)
    rows = effects(db.engine)
    # Every job started before any finished: four threads ran them side by side.
    first_finish = next(i for i, r in enumerate(rows) if r[2] == "finish")
    assert sorted(r[0] for r in rows[:first_finish]) == ids


def test_stop_from_another_thread(db: Database) -> None:
    from sqla_jobs import Worker

    worker = Worker(db.engine, app.queue, concurrency=1, poll_interval=0.05)
    timer = threading.Timer(0.3, worker.stop)
    timer.start()
    assert worker.run(install_signals=False) == 0  # returned because of stop(), not burst
    enqueue(db.engine, "noop")
    assert count(db.engine, app.Job, app.Job.state == "pending") == 1


def test_hook_events_for_every_outcome(db: Database) -> None:
    got: list[str] = []
    q: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)
    for name in ("started", "finished", "cancelled", "snoozed"):
        q.on(name)(lambda e: got.append(f"{e.name}:{e.kind}"))
    for kind, fn in app.queue.handlers.items():
        q.handlers[kind] = fn
    enqueue(db.engine, "noop")
    enqueue(db.engine, "cancel")
    enqueue(db.engine, "snooze", {"seconds": 60})
    run_burst(db.engine, q, concurrency=1)
    assert sorted(got) == sorted(["started:noop", "finished:noop", "started:cancel", "cancelled:cancel",
                                  "started:snooze", "snoozed:snooze"])


def test_session_unaffected(db: Database) -> None:
    """The worker uses its own connections: an open user session sees the result after refresh."""
    with Session(db.engine) as session:
        job_id = enqueue(db.engine, "noop")
        run_burst(db.engine)
        row = session.get(app.Job, job_id)
        assert row is not None and row.state == "finished"


default_policy: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)
default_policy.handler("fail")(slow_fail)


def test_default_first_retry_is_one_minute_not_two(db: Database) -> None:
    """The seed article's code waited 2 ** attempts minutes after the claim counted the attempt: 2, not 1."""
    job_id = enqueue(db.engine, "fail", max_attempts=5)
    before = db_now(db.engine)
    run_burst(db.engine, default_policy)
    after = db_now(db.engine)
    row = job(db.engine, job_id)
    assert row is not None and (row.state, row.attempts) == ("pending", 1)
    slack = timedelta(seconds=2)
    assert before + timedelta(seconds=54) - slack <= utc(row.run_at) <= after + timedelta(seconds=66) + slack


def _hold_write_lock(path: Path, seconds: float, holding: threading.Event) -> None:
    """Another connection of the app writing: BEGIN IMMEDIATE held for ``seconds``, then committed."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO effects (job_id, attempt, event, pid) VALUES (0, 0, 'app', 0)")
        holding.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
    finally:
        conn.close()


@pytest.mark.parametrize("switch_wait", [30.0, 0.3], ids=["lock-released", "lock-outlasts-the-wait"])
def test_a_sqlite_worker_starts_beside_an_app_that_is_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, switch_wait: float
) -> None:
    # SQLite refuses the switch to WAL at once while another connection writes (no busy wait); a worker
    # thread started in a busy web process used to die of it (CI: the FastAPI recipe on SQLite).
    path = tmp_path / "jobs.db"
    engine = create_engine(f"sqlite:///{path}")
    app.Base.metadata.create_all(engine)  # as the FastAPI recipe makes its tables (create_tables would switch to WAL)
    assert _journal_mode(path) == "delete"
    job_id = enqueue(engine, "noop")
    monkeypatch.setattr(sqlite_driver, "WAL_SWITCH_WAIT", switch_wait)
    holding = threading.Event()
    writer = threading.Thread(target=_hold_write_lock, args=(path, 1.0, holding))
    writer.start()
    assert holding.wait(10)
    try:
        with caplog.at_level(logging.WARNING, logger="sqla_jobs"):
            worker = run_burst(engine)
    finally:
        writer.join()
    assert worker.processed == 1
    assert job(engine, job_id).state == "finished"
    if switch_wait > 1.0:
        assert _journal_mode(path) == "wal"
        assert "not in WAL mode" not in caplog.text
    else:
        assert _journal_mode(path) == "delete"  # went on without it, and said so
        assert "stayed busy" in caplog.text and "not in WAL mode" in caplog.text
    engine.dispose()


def _journal_mode(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()
    finally:
        conn.close()
