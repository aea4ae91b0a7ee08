"""insert_many, the stats queries and the database clock, on every driver."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from sqla_jobs.drivers.base import percentile
from tests.drivers.conftest import Backend, in_write
from tests.helpers import utc

PAST = datetime(2020, 1, 1, tzinfo=timezone.utc)


def test_insert_many_keeps_every_field_and_defaults_run_at_to_the_database_clock(backend: Backend) -> None:
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    rows = [
        {"kind": "a", "queue": "q1", "payload": json.dumps({"n": 1, "s": "é"}), "priority": 3,
         "max_attempts": 2, "run_at": None},
        {"kind": "b", "queue": "q2", "payload": json.dumps({}), "priority": -1, "max_attempts": 9, "run_at": later},
    ]
    before = utc(backend.now())
    in_write(backend, lambda c: backend.driver.insert_many(c, rows))
    t = backend.driver.jobs
    with backend.db.engine.connect() as conn:
        got = {r.kind: r for r in conn.execute(select(t))}
    a = got["a"]
    assert (a.queue, a.payload, a.priority, a.max_attempts) == ("q1", {"n": 1, "s": "é"}, 3, 2)
    assert got["a"].state == "pending" and got["a"].attempts == 0
    assert abs((utc(got["a"].run_at) - before).total_seconds()) < 60
    assert abs((utc(got["b"].run_at) - later).total_seconds()) < 0.01
    assert [j.kind for j in backend.claim(10)] == ["a"]


def test_the_database_clock(backend: Backend) -> None:
    d = backend.driver
    assert abs((utc(backend.now()) - datetime.now(timezone.utc)).total_seconds()) < 60
    assert backend.scalar(d.seconds_between(d.later(90), d.now())) == pytest.approx(90, abs=1)
    assert backend.scalar(d.seconds_between(d.now(), d.ago(30))) == pytest.approx(30, abs=1)
    assert utc(backend.scalar(d.later(0.5))) > utc(backend.scalar(d.ago(0.5)))


def test_stats_queries(backend: Backend) -> None:
    d = backend.driver
    backend.insert(2, queue="q1", run_at=PAST)
    backend.insert(1, queue="q1", run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    backend.insert(3, queue="q2", run_at=PAST)
    running = backend.claim(2, queues=["q2"])
    backend.set(running[0].id, lease_expires_at=d.ago(10))
    with backend.db.engine.connect() as conn:
        pending = {r.queue: r for r in d.pending_by_queue(conn)}
        assert (pending["q1"].ready, pending["q1"].scheduled, pending["q2"].ready) == (2, 1, 1)
        assert pending["q1"].oldest_age > 3600 * 24 * 300  # due since 2020
        assert [(r.queue, r.running, r.expired) for r in d.running_by_queue(conn)] == [("q2", 2, 1)]


def test_run_times_per_kind(backend: Backend) -> None:
    d = backend.driver
    durations = [1.0, 2.0, 4.0, 10.0]
    ids = backend.insert(len(durations), kind="timed", run_at=PAST)
    backend.claim(10)
    for job_id, took in zip(ids, durations, strict=True):
        backend.set(job_id, state="finished", locked_at=d.ago(60 + took), finished_at=d.ago(60))
    old = backend.insert(kind="timed", run_at=PAST)[0]  # finished outside the window: not counted
    backend.claim(1)
    backend.set(old, state="finished", locked_at=d.ago(7300), finished_at=d.ago(7200))
    [(kind, count, mean, p50, p95, top)] = in_write(backend, lambda c: d.run_times(c, 3600))
    assert (kind, count) == ("timed", 4)
    assert mean == pytest.approx(4.25, abs=0.01)
    assert p50 == pytest.approx(percentile(durations, 0.5), abs=0.01)
    assert p95 == pytest.approx(percentile(durations, 0.95), abs=0.01)
    assert top == pytest.approx(10.0, abs=0.01)


def test_dead_by_kind(backend: Backend) -> None:
    d = backend.driver
    for _ in range(2):
        backend.insert(kind="bad", run_at=PAST)
        [job] = backend.claim(1)
        in_write(backend, lambda c, job=job: d.dead_letter(c, job.fence, "no"))
    with backend.db.engine.connect() as conn:
        assert [(r.kind, r.total, r.recent) for r in d.dead_by_kind(conn, 3600)] == [("bad", 2, 2)]


def test_make_due_moves_only_pending_jobs_scheduled_later(backend: Backend) -> None:
    later = datetime.now(timezone.utc) + timedelta(days=1)
    due = backend.insert(1, run_at=PAST)
    scheduled = backend.insert(2, kind="a", run_at=later) + backend.insert(1, kind="b", run_at=later)
    assert in_write(backend, lambda c: backend.driver.make_due(c, "a")) == 2
    assert utc(backend.row(due[0]).run_at) == PAST  # due already: its place in line is kept
    assert [utc(backend.row(i).run_at) <= utc(backend.now()) for i in scheduled] == [True, True, False]
    assert in_write(backend, lambda c: backend.driver.make_due(c)) == 1
    assert in_write(backend, lambda c: backend.driver.make_due(c)) == 0
