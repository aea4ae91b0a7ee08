"""Durable jobs (sqla_jobs._durable, docs/howto/durable.md): steps run once, sleeps and waits park the job.

In-process workers on every backend; the crash proofs (SIGKILL at each step boundary) are in
tests/test_durable_crash.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from sqla_jobs import AsyncWorker, InvalidJob, Worker
from tests import durable_app
from tests.conftest import Database
from tests.helpers import effects, enqueue, job, run_burst, utc
from tests.test_asyncio import async_url

queue = durable_app.queue


def steps(db: Database, job_id: int) -> dict[str, Any]:
    with Session(db.engine) as session:
        return {row.name: row for row in queue.job_steps(session, job_id)}


def ran(db: Database, job_id: int) -> list[str]:
    return [event for _, _, event in effects(db.engine, job_id) if event.startswith("step-")]


def emit(db: Database, key: str, data: Any) -> int | None:
    with Session(db.engine) as session, session.begin():
        return queue.emit_event(session, key, data)


def test_a_step_that_failed_is_run_again_and_the_steps_before_it_are_not(db: Database) -> None:
    job_id = enqueue(db.engine, "d_steps", {"n": 5, "fail_at": 2})
    run_burst(db.engine)
    row = job(db.engine, job_id)
    assert row is not None and row.state == "finished", row.last_error
    assert row.attempts == 2 and "the step failed" in str(row.errors)
    assert row.result == ["s0", "s1", "s2", "s3", "s4"]
    assert ran(db, job_id) == ["step-s0", "step-s1", "step-s2", "step-s3", "step-s4"]
    stored = steps(db, job_id)
    assert [stored[f"s{i}"].value for i in range(5)] == ["s0", "s1", "s2", "s3", "s4"]
    assert all(r.finished_at is not None for r in stored.values())


def test_a_sleep_parks_the_job_without_an_attempt_and_the_next_run_passes_it(db: Database) -> None:
    job_id = enqueue(db.engine, "d_sleep", {"seconds": 1.0})
    run_burst(db.engine)
    parked = job(db.engine, job_id)
    assert parked is not None and parked.state == "pending" and parked.attempts == 0
    sleep = steps(db, job_id)["sleep:1"]
    assert sleep.finished_at is None and sleep.awaiting is None
    assert abs((utc(parked.run_at) - utc(sleep.until)).total_seconds()) < 0.5  # due when the sleep ends
    time.sleep(max(0.0, (utc(sleep.until) - datetime.now(timezone.utc)).total_seconds()) + 0.2)
    run_burst(db.engine)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished" and done.result == "woke" and done.attempts == 1
    assert ran(db, job_id) == ["step-before", "step-after"]
    assert steps(db, job_id)["sleep:1"].finished_at is not None


def test_a_wait_parks_until_the_emit_commits_and_a_rolled_back_emit_wakes_nothing(db: Database) -> None:
    job_id = enqueue(db.engine, "d_wait", {"key": "paid:1"})
    run_burst(db.engine)
    parked = job(db.engine, job_id)
    assert parked is not None and parked.state == "pending" and parked.attempts == 0
    assert utc(parked.run_at) > datetime.now(timezone.utc) + timedelta(minutes=30)
    with Session(db.engine) as session:
        assert queue.waiting_for(session, "paid:1") == [job_id]
    assert steps(db, job_id)["event:paid:1"].awaiting == "paid:1"
    with Session(db.engine) as session:
        assert queue.emit_event(session, "paid:1", {"amount": 1}) == 1
        session.rollback()
    assert utc(job(db.engine, job_id).run_at) == utc(parked.run_at)  # type: ignore[union-attr]
    with Session(db.engine) as session:
        assert queue.get_event(session, "paid:1") is None
    assert emit(db, "paid:1", {"amount": 42}) == 1
    assert emit(db, "paid:1", {"amount": 99}) is None  # the first emit wins
    run_burst(db.engine)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished", done.last_error
    assert done.result == {"data": {"amount": 42}}
    assert ran(db, job_id) == ["step-before", "step-after"]


def test_a_wait_for_an_event_emitted_before_returns_at_once(db: Database) -> None:
    emit(db, "early", [1, 2])
    job_id = enqueue(db.engine, "d_wait", {"key": "early"})
    run_burst(db.engine)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished" and done.result == {"data": [1, 2]}


def test_a_wait_that_times_out_returns_none_and_keeps_that_answer(db: Database) -> None:
    job_id = enqueue(db.engine, "d_wait", {"key": "never", "timeout": 0.5})
    run_burst(db.engine)
    assert job(db.engine, job_id).state == "pending"  # type: ignore[union-attr]
    time.sleep(0.7)
    run_burst(db.engine)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished" and done.result == {"data": None}
    assert emit(db, "never", "late") == 0  # nobody waits any more
    assert steps(db, job_id)["event:never"].value is None


def test_a_transactional_handler_commits_its_steps_with_its_writes_when_it_parks(db: Database) -> None:
    job_id = enqueue(db.engine, "d_tx", {"key": "tx"})
    run_burst(db.engine)
    assert job(db.engine, job_id).state == "pending"  # type: ignore[union-attr]
    assert ran(db, job_id) == ["step-t0"]  # committed with its checkpoint, though the job did not finish
    assert emit(db, "tx", None) == 1
    run_burst(db.engine)
    done = job(db.engine, job_id)
    assert done is not None and done.state == "finished" and done.result == "done", done.last_error
    assert ran(db, job_id) == ["step-t0", "step-t1"]


def test_a_step_name_used_twice_and_a_value_json_cannot_store_fail_the_run(db: Database) -> None:
    twice = enqueue(db.engine, "d_twice", max_attempts=1)
    bad = enqueue(db.engine, "d_bad_value", max_attempts=1)
    run_burst(db.engine)
    with Session(db.engine) as session:
        assert "used twice" in (queue.get_dead(session, twice).last_error or "")
        assert "InvalidJob" in (queue.get_dead(session, bad).last_error or "")
    with Session(db.engine) as session, session.begin(), pytest.raises(InvalidJob, match="event key"):
        queue.emit_event(session, "", 1)


def test_async_handlers_have_the_same_under_the_async_worker_and_the_threaded_one(db: Database) -> None:
    first = enqueue(db.engine, "d_async_wait", {"key": "a1", "seconds": 0.3})
    second = enqueue(db.engine, "d_async_wait", {"key": "a2", "seconds": 0.3})

    async def burst(engine: AsyncEngine) -> None:
        await AsyncWorker(engine, queue, concurrency=2, poll_interval=0.05).run(burst=True)

    async def scenario() -> None:
        engine = create_async_engine(async_url(db))
        try:
            await burst(engine)
            async with engine.begin() as conn:  # the AsyncSession twin emits in its transaction
                from sqlalchemy.ext.asyncio import AsyncSession
                async with AsyncSession(bind=conn) as session:
                    assert await queue.aio.emit_event(session, "a1", "one") == 1
            emit(db, "a2", "two")
            await burst(engine)  # passes the waits, parks at the sleeps
            await asyncio.sleep(0.5)
            await burst(engine)
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    for job_id, data in ((first, "one"), (second, "two")):
        done = job(db.engine, job_id)
        assert done is not None and done.state == "finished" and done.result == {"data": data}, done.last_error
        assert ran(db, job_id) == ["step-before", "step-after"]
    third = enqueue(db.engine, "d_async_wait", {"key": "a3"})
    emit(db, "a3", 3)
    run_burst(db.engine)  # the threaded worker runs the async handler on its own loop
    assert job(db.engine, third).result == {"data": 3}  # type: ignore[union-attr]


def test_prune_takes_a_pruned_jobs_steps_and_old_events_with_it(db: Database) -> None:
    emit(db, "pruned", 1)
    job_id = enqueue(db.engine, "d_wait", {"key": "pruned"})
    run_burst(db.engine)
    assert steps(db, job_id)
    time.sleep(0.05)
    queue.prune(db.engine, older_than=0)
    assert job(db.engine, job_id) is None and steps(db, job_id) == {}
    with Session(db.engine) as session:
        assert queue.get_event(session, "pruned") is None


def test_an_emit_wakes_a_listening_postgresql_worker_at_once(pg: Database) -> None:
    """The emit's commit notifies the listening workers: one that polls only every 30 s resumes the job at once."""
    queue.create_tables(pg.engine)
    worker = Worker(pg.engine, queue, concurrency=2, poll_interval=30, listen=True)
    thread = threading.Thread(target=lambda: worker.run(install_signals=False))
    thread.start()
    try:
        job_id = enqueue(pg.engine, "d_wait", {"key": "listen"})  # the insert's own NOTIFY: it parks at once
        began = time.monotonic()
        while not steps(pg, job_id).get("event:listen") and time.monotonic() - began < 15:
            time.sleep(0.05)
        time.sleep(0.5)  # parked, and the worker back to its wait
        emit(pg, "listen", "now")
        began = time.monotonic()
        while job(pg.engine, job_id).state != "finished" and time.monotonic() - began < 15:  # type: ignore[union-attr]
            time.sleep(0.05)
        waited = time.monotonic() - began
    finally:
        worker.stop()
        thread.join(30)
    assert job(pg.engine, job_id).result == {"data": "now"} and waited < 10, f"waited {waited:.1f}s for a poll"  # type: ignore[union-attr]


def test_woken_waiters_find_their_wait_passed_and_their_steps_read_with_the_claim(db: Database) -> None:
    """The emit ends the parked waits with its data in its own transaction; a worker that has run a kind's steps reads
    the steps of the jobs of that kind it claims in one statement, not one per job (each on its handler thread)."""
    ids = [enqueue(db.engine, "d_wait", {"key": f"paid:{i}"}) for i in range(12)]
    run_burst(db.engine)  # all park
    with Session(db.engine) as session, session.begin():
        assert [queue.emit_event(session, f"paid:{i}", {"n": i}) for i in range(12)] == [1] * 12
    for i, job_id in enumerate(ids):
        wait = steps(db, job_id)[f"event:paid:{i}"]
        assert wait.finished_at is not None and wait.value == {"n": i}  # passed by the emit
    reads: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM jobs_steps" in statement or "FROM jobs_events" in statement:
            reads.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        Worker(db.engine, queue, concurrency=4, poll_interval=0.05).run(burst=True, install_signals=False)
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    for i, job_id in enumerate(ids):
        done = job(db.engine, job_id)
        assert done is not None and done.state == "finished" and done.result == {"data": {"n": i}}, done
        assert ran(db, job_id) == ["step-before", "step-after"]
    # No event read at all. A run reads its own steps only before the worker has learnt the kind (its first claim,
    # of at most 4 jobs); after that each claim's jobs get theirs in one statement.
    assert not any("FROM jobs_events" in r for r in reads), reads
    own = [r for r in reads if " IN " not in r.upper()]
    assert 1 <= len(own) <= 4 and len(reads) - len(own) >= 1, reads
