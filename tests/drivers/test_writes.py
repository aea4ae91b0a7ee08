"""Every write after a claim is fenced; heartbeats, the reaper's view, retry, dead letter, requeue, prune."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import Connection, text, update
from sqlalchemy.exc import DBAPIError

from sqla_jobs.drivers.base import MAX_ERROR_LENGTH, Claimed, Fence
from tests.drivers.conftest import Backend, in_write

PAST = datetime(2020, 1, 1, tzinfo=timezone.utc)

# Each post-claim write, given a connection and a fence; returns whether it changed anything.
WRITES: dict[str, Callable[[Any, Connection, Fence], bool]] = {
    "finish": lambda d, c, f: bool(d.finish(c, [f])),
    "heartbeat": lambda d, c, f: bool(d.heartbeat(c, [f], 60.0)),
    "release": lambda d, c, f: d.release(c, f, error="boom", attempt=1),
    "release_cancel": lambda d, c, f: d.release(c, f, cancel=True),
    "dead_letter": lambda d, c, f: d.dead_letter(c, f, "boom"),
    "release_many": lambda d, c, f: bool(d.release_many(c, [f], refund=True, isolate=None)),
    "finish_and_claim": lambda d, c, f: bool(d.finish_and_claim(c, [f], 0, "w", "t", 60.0, None)[0]),
}


def _claimed(backend: Backend) -> Claimed:
    backend.insert(run_at=PAST)
    [job] = backend.claim(1)
    return job


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_with_a_lost_claim_changes_nothing(backend: Backend, write: str) -> None:
    job = _claimed(backend)
    before = backend.row(job.id)
    apply = WRITES[write]
    assert not in_write(backend, lambda c: apply(backend.driver, c, (job.id, "someone-else")))
    assert not in_write(backend, lambda c: apply(backend.driver, c, (job.id + 1000, job.token)))
    assert backend.row(job.id) == before
    assert backend.dead_row(job.id) is None
    # The real fence works, once: afterwards the job is no longer running under it.
    assert in_write(backend, lambda c: apply(backend.driver, c, job.fence))
    if write != "heartbeat":
        assert not in_write(backend, lambda c: apply(backend.driver, c, job.fence))


def test_heartbeat_extends_held_leases_and_reports_lost_ones(backend: Backend) -> None:
    job = _claimed(backend)
    backend.set(job.id, lease_expires_at=backend.driver.later(5))
    before = backend.row(job.id).lease_expires_at
    kept = in_write(backend, lambda c: backend.driver.heartbeat(c, [job.fence, (job.id, "lost")], 600.0))
    assert kept == {job.fence}
    assert backend.row(job.id).lease_expires_at > before
    assert in_write(backend, lambda c: backend.driver.heartbeat(c, [], 60.0)) == set()


def test_expired_lists_running_jobs_whose_lease_ran_out(backend: Backend) -> None:
    gone, alive = _claimed(backend), _claimed(backend)
    backend.set(gone.id, lease_expires_at=backend.driver.ago(5))
    rows = in_write(backend, lambda c: backend.driver.expired(c))
    assert [(r.id, r.claim_token, r.attempts, r.locked_by) for r in rows] == [(gone.id, gone.token, 1, "conformance")]
    assert alive.id not in {r.id for r in rows}


def test_expired_waits_until_the_server_has_been_up_for_settle_seconds(backend: Backend) -> None:
    """After a server start every lease may have run out under a live worker (an outage): not yet reaped."""
    gone = _claimed(backend)
    backend.set(gone.id, lease_expires_at=backend.driver.ago(5))
    uptime = in_write(backend, lambda c: backend.driver.server_uptime(c))
    if backend.name == "sqlite":
        assert uptime is None  # no server: nothing restarts under the workers
    else:
        assert isinstance(uptime, float) and uptime > 0
        assert in_write(backend, lambda c: backend.driver.expired(c, settle=uptime + 3600)) == []
    rows = in_write(backend, lambda c: backend.driver.expired(c, settle=min(uptime or 1.0, 1.0) / 2))
    assert [r.id for r in rows] == [gone.id]


def test_retry_keeps_the_error_history_and_delays(backend: Backend) -> None:
    job = _claimed(backend)
    assert in_write(backend, lambda c: backend.driver.release(c, job.fence, delay=3600, error="first", attempt=1))
    row = backend.row(job.id)
    assert (row.state, row.attempts, row.last_error, row.claim_token) == ("pending", 1, "first", None)
    assert [e["error"] for e in row.errors] == ["first"] and row.errors[0]["attempt"] == 1
    assert backend.claim(1) == []  # its run_at is an hour ahead
    backend.set(job.id, run_at=PAST)
    [again] = backend.claim(1)
    assert again.attempt == 2
    assert in_write(backend, lambda c: backend.driver.release(c, again.fence, error="x" * 10_000, attempt=2))
    row = backend.row(job.id)
    assert [e["attempt"] for e in row.errors] == [1, 2]
    assert len(row.last_error) <= MAX_ERROR_LENGTH and row.last_error.endswith("[truncated]")


def test_refund_cancel_and_requested_cancel(backend: Backend) -> None:
    job = _claimed(backend)
    assert in_write(backend, lambda c: backend.driver.release_many(c, [job.fence], refund=True, isolate=None)) == 1
    assert (backend.row(job.id).state, backend.row(job.id).attempts) == ("pending", 0)
    [job] = backend.claim(1)
    assert in_write(backend, lambda c: backend.driver.cancel(c, job.id)) == (True, "running")
    assert in_write(backend, lambda c: backend.driver.cancel_requested(c, job.fence))
    assert in_write(backend, lambda c: backend.driver.release(c, job.fence, delay=1))
    row = backend.row(job.id)
    assert row.state == "cancelled" and row.finished_at is not None


def test_dead_letter_and_requeue(backend: Backend) -> None:
    job = _claimed(backend)
    assert in_write(backend, lambda c: backend.driver.dead_letter(c, job.fence, "gave up"))
    assert backend.row(job.id) is None
    dead = backend.dead_row(job.id)
    assert (dead.kind, dead.attempts, dead.last_error) == ("noop", 1, "gave up")
    assert dead.errors[-1]["error"] == "gave up" and dead.failed_at is not None
    assert in_write(backend, lambda c: backend.driver.requeue_dead(c, ids=[job.id])) == [job.id]
    row = backend.row(job.id)
    assert (row.state, row.attempts, row.payload) == ("pending", 0, job.payload)
    assert "requeued from the dead-letter table" in row.last_error
    assert backend.dead_row(job.id) is None
    assert [j.id for j in backend.claim(1)] == [job.id]


def test_prune_deletes_only_old_finished_and_cancelled_jobs(backend: Backend) -> None:
    old, recent, running = _claimed(backend), _claimed(backend), _claimed(backend)
    in_write(backend, lambda c: backend.driver.finish(c, [old.fence, recent.fence]))
    # Three days old: older than any day partition create-tables makes, so a partitioned table's
    # prune removes it too (it drops whole days, and deletes by age only what no day partition took).
    backend.set(old.id, finished_at=backend.driver.ago(3 * 86400))
    backend.set(running.id, finished_at=backend.driver.ago(3 * 86400))  # running: never pruned
    assert in_write(backend, lambda c: backend.driver.prune_lock(c))
    assert in_write(backend, lambda c: backend.driver.prune_batch(c, 3600, 10)) == 1
    assert backend.row(old.id) is None
    assert backend.row(recent.id) is not None and backend.row(running.id) is not None


def test_a_deadlock_is_a_conflict_to_retry_not_a_disconnect(backend: Backend) -> None:
    """Two transactions locking two rows in opposite orders: the database kills one, and the
    driver calls that a conflict (what ``prune`` retries), not a lost connection."""
    first, second = backend.insert(2)
    t = backend.driver.jobs
    with backend.db.engine.connect() as conn:
        try:
            conn.execute(text("SELECT no_such_column FROM no_such_table"))
        except DBAPIError as exc:
            assert not backend.driver.is_conflict(exc)
    if backend.name == "sqlite":
        return  # one writer at a time: SQLite cannot deadlock, so there is no conflict to classify
    errors: list[BaseException] = []
    both_hold_one = threading.Barrier(2, timeout=30)

    def lock(a: int, b: int) -> None:
        try:
            with backend.write() as conn:
                conn.execute(update(t).where(t.c.id == a).values(priority=1))
                both_hold_one.wait()
                conn.execute(update(t).where(t.c.id == b).values(priority=1))
        except DBAPIError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lock, args=pair) for pair in ((first, second), (second, first))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 1, errors
    assert backend.driver.is_conflict(errors[0]) and not backend.driver.is_disconnect(errors[0])
