"""Durable jobs' statements (``drivers/_durable.py``): steps, parking, the emit/park rendezvous, pruning events."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Connection, func, select

from tests.drivers.conftest import Backend, in_write
from tests.drivers.test_writes import PAST


def _parked(backend: Backend, key: str | None, seconds: float = 3600) -> tuple[int, datetime]:
    """A claimed job parked at a wait for ``key`` (a sleep without one) for ``seconds``, as the worker does
    it: the park, then the release as a snooze, in one transaction."""
    [job_id] = backend.insert(1, run_at=PAST)
    [claimed] = backend.claim(1)
    until = datetime.now(timezone.utc) + timedelta(seconds=seconds)

    def park(conn: Connection) -> None:
        emitted = backend.driver.park(conn, job_id, "wait", until, datetime.now(timezone.utc), key)
        backend.driver.release(conn, claimed.fence, delay=0 if emitted else seconds, refund=True)

    in_write(backend, park)
    return job_id, until


def _emit(backend: Backend, key: str, data: Any) -> int | None:
    return in_write(backend, lambda conn: backend.driver.emit(conn, key, data))  # type: ignore[no-any-return]


def _due(backend: Backend, job_id: int) -> bool:
    row = backend.row(job_id)
    now = backend.now()
    return row.state == "pending" and row.run_at.replace(tzinfo=None) <= now.replace(tzinfo=None)


def test_an_emit_makes_the_parked_jobs_due_once_and_the_first_emit_wins(backend: Backend) -> None:
    a, _ = _parked(backend, "k")
    b, _ = _parked(backend, "k")
    other, _ = _parked(backend, "other")
    assert not _due(backend, a)
    assert in_write(backend, lambda conn: backend.driver.waiting_for(conn, "k")) == [a, b]
    assert _emit(backend, "k", {"n": 1}) == 2
    assert _due(backend, a) and _due(backend, b) and not _due(backend, other)
    assert _emit(backend, "k", {"n": 2}) is None
    event = in_write(backend, lambda conn: backend.driver.event(conn, "k"))
    assert event.data == {"n": 1} and event.emitted_at is not None
    assert in_write(backend, lambda conn: backend.driver.event(conn, "other")) is None  # only a rendezvous


def test_a_park_after_the_emit_is_due_at_once_and_records_no_wait(backend: Backend) -> None:
    assert _emit(backend, "early", [1]) == 0
    job_id, _ = _parked(backend, "early")
    assert _due(backend, job_id)
    assert in_write(backend, lambda conn: backend.driver.waiting_for(conn, "early")) == []


def _emit_racing_a_park(backend: Backend, key: str, emit: Any) -> tuple[int, list[Any]]:
    """A park of a wait for ``key`` in flight while ``emit(conn)`` runs in another thread: what the emit answered,
    which must be nothing before the park commits (the park's transaction holds the key's rendezvous row)."""
    [job_id] = backend.insert(1, run_at=PAST)
    [claimed] = backend.claim(1)
    parked, answers = threading.Event(), []

    def emitter() -> None:
        parked.wait()
        answers.append(in_write(backend, emit))

    thread = threading.Thread(target=emitter)
    thread.start()
    with backend.write() as conn:
        until = datetime.now(timezone.utc) + timedelta(hours=1)
        assert backend.driver.park(conn, job_id, "wait", until, until, key) is False
        backend.driver.release(conn, claimed.fence, delay=3600, refund=True)
        parked.set()
        time.sleep(0.5)  # the emit is under way meanwhile, and must wait for this commit
        assert answers == []
    thread.join(30)
    return job_id, answers


def test_an_emit_racing_a_park_in_flight_waits_for_it_and_wakes_it(backend: Backend) -> None:
    job_id, woken = _emit_racing_a_park(backend, "race", lambda conn: backend.driver.emit(conn, "race", "x"))
    assert woken == [1] and _due(backend, job_id)


def test_an_emit_of_many_racing_a_park_in_flight_waits_for_it_and_wakes_it(backend: Backend) -> None:
    """The rendezvous holds for ``emit_many`` too: its keys' rows wait for the park's, then it sees the parked step."""
    job_id, answers = _emit_racing_a_park(backend, "race3",
                                          lambda conn: backend.driver.emit_many(conn, {"other": 1, "race3": 2}))
    assert answers == [({"other", "race3"}, 1)] and _due(backend, job_id)
    steps = {r.name: r for r in in_write(backend, lambda conn: backend.driver.job_steps(conn, job_id))}
    assert steps["wait"].value == 2 and steps["wait"].finished_at is not None


def test_a_park_racing_an_emit_in_flight_waits_for_it_and_reads_it(backend: Backend) -> None:
    [job_id] = backend.insert(1, run_at=PAST)
    backend.claim(1)
    emitting, answers = threading.Event(), []

    def parker() -> None:
        emitting.wait()
        with backend.write() as conn:
            until = datetime.now(timezone.utc) + timedelta(hours=1)
            answers.append(backend.driver.park(conn, job_id, "wait", until, until, "race2"))

    thread = threading.Thread(target=parker)
    thread.start()
    with backend.write() as conn:
        assert backend.driver.emit(conn, "race2", 7) == 0
        emitting.set()
        time.sleep(0.5)
        assert answers == []
    thread.join(30)
    assert answers == [True]


def test_a_rolled_back_emit_leaves_no_event_and_wakes_nothing(backend: Backend) -> None:
    job_id, _ = _parked(backend, "rb")
    with backend.db.engine.connect() as conn:
        backend.driver.begin_write(conn)
        assert backend.driver.emit(conn, "rb", 1) == 1
        conn.rollback()
    assert not _due(backend, job_id)
    assert in_write(backend, lambda conn: backend.driver.event(conn, "rb")) is None
    assert _emit(backend, "rb", 2) == 1


def test_steps_are_saved_over_a_parked_row_and_read_back_in_order(backend: Backend) -> None:
    job_id, _ = _parked(backend, "s")
    start = datetime.now(timezone.utc)
    in_write(backend, lambda conn: backend.driver.save_step(conn, job_id, "after", {"v": [1]}, start, start))
    in_write(backend, lambda conn: backend.driver.save_step(conn, job_id, "wait", "data", start, start))
    rows = {r.name: r for r in in_write(backend, lambda conn: backend.driver.job_steps(conn, job_id))}
    assert rows["after"].value == {"v": [1]} and rows["after"].finished_at is not None
    assert rows["wait"].value == "data" and rows["wait"].awaiting is None and rows["wait"].until is not None
    assert in_write(backend, lambda conn: backend.driver.waiting_for(conn, "s")) == []
    in_write(backend, lambda conn: backend.driver.forget_steps(conn, [job_id]))
    assert in_write(backend, lambda conn: backend.driver.job_steps(conn, job_id)) == []


def test_hold_is_fenced_by_the_claim(backend: Backend) -> None:
    backend.insert(1, run_at=PAST)
    [claimed] = backend.claim(1)
    assert in_write(backend, lambda conn: backend.driver.hold(conn, claimed.fence)) is True
    assert in_write(backend, lambda conn: backend.driver.hold(conn, (claimed.id, "not-ours"))) is False


def test_prune_events_keeps_recent_events_and_awaited_rendezvous(backend: Backend) -> None:
    _emit(backend, "old", 1)
    _parked(backend, "awaited")
    later = datetime.now(timezone.utc) + timedelta(days=1)
    earlier = datetime.now(timezone.utc) - timedelta(days=1)
    assert in_write(backend, lambda conn: backend.driver.prune_events(conn, earlier)) == 0
    assert in_write(backend, lambda conn: backend.driver.prune_events(conn, later)) == 1  # "old"
    count = backend.scalar(select(func.count()).select_from(backend.driver.events).scalar_subquery())
    assert count == 1  # the rendezvous of the job still waiting
