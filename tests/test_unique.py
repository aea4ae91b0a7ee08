"""Unique jobs: one holder per key, enforced by the database, and a duplicate never aborts the caller."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import datetime, timezone

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sqla_jobs import Enqueued, InvalidJob, unique_key
from tests import app, forkserver
from tests.conftest import ROOT, Database
from tests.helpers import count, run_burst


def test_duplicate_returns_the_holder_and_the_transaction_commits(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        first = app.queue.enqueue_unique(session, "noop", {"order": 42}, unique_key="order-42")
        session.add(app.Once(job_id=-1))  # the caller's business row, after and before the duplicate
        second = app.queue.enqueue_unique(session, "noop", {"order": 42, "again": True}, unique_key="order-42")
        session.add(app.Once(job_id=-2))
    assert isinstance(first, Enqueued) and first.inserted and not second.inserted
    assert second.id == first.id and second.job.payload == {"order": 42}
    assert count(db.engine, app.Job) == 1 and count(db.engine, app.Once) == 2

    # Another transaction: the pending job holds the key.
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        third = app.queue.enqueue_unique(session, "noop", {}, unique_key="order-42")
        assert not third.inserted and third.id == first.id
    assert app.queue.enqueue is not None
    run_burst(db.engine)  # finished: pending and running were its unique states, so the key is free
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        fourth = app.queue.enqueue_unique(session, "noop", {}, unique_key="order-42")
        assert fourth.inserted and fourth.id != first.id
        assert fourth.job.unique_key == "order-42" and fourth.job.unique_states == ("pending", "running")
    with Session(db.engine) as session:
        listed = app.queue.list_jobs(session, unique_key="order-42")
    assert sorted(r.state for r in listed) == ["finished", "pending"]


def test_enqueue_with_a_key_is_enqueue_unique(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        a = app.queue.enqueue(session, "noop", {}, unique_key="k")
        b = app.queue.enqueue(session, "noop", {}, unique_key="k")
        assert a is b
    assert count(db.engine, app.Job) == 1


def test_plain_session_add_fails_at_flush(db: Database) -> None:
    """What docs/howto/unique-jobs.md says about session.add: the flush raises IntegrityError."""
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        session.add(app.Job(kind="noop", payload={}, unique_key="same"))
    with pytest.raises(IntegrityError), Session(db.engine, expire_on_commit=False) as session, session.begin():
        session.add(app.Job(kind="noop", payload={}, unique_key="same"))
    assert count(db.engine, app.Job) == 1


def test_finished_state_keeps_the_key_and_cancelled_frees_it(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        kept = app.queue.enqueue_unique(session, "noop", {}, unique_key="daily",
                                        unique_states=["pending", "running", "finished"])
        freed = app.queue.enqueue_unique(session, "noop", {}, unique_key="other")
    run_burst(db.engine)
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        assert not app.queue.enqueue_unique(session, "noop", {}, unique_key="daily").inserted
        assert app.queue.enqueue_unique(session, "noop", {}, unique_key="other").inserted
        again = app.queue.enqueue_unique(session, "noop", {}, unique_key="cancel-me")
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        assert app.queue.cancel(session, again.id) == "cancelled"
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        assert app.queue.enqueue_unique(session, "noop", {}, unique_key="cancel-me").inserted
    assert kept.inserted and freed.inserted


def test_period_is_once_per_window(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        first = app.queue.enqueue_unique(session, "noop", {}, unique_key="digest", unique_period=3600)
    run_burst(db.engine)
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        again = app.queue.enqueue_unique(session, "noop", {}, unique_key="digest", unique_period=3600)
    hour = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:00:00Z")
    assert first.inserted and not again.inserted and first.job.unique_key == f"digest@{hour}"
    with Session(db.engine) as session:
        assert [r.id for r in app.queue.list_jobs(session, unique_key="digest")] == [first.id]


def test_enqueue_many_with_keys_skips_held_ones(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        app.queue.enqueue_unique(session, "noop", {}, unique_key="a")
        inserted = app.queue.enqueue_many(session, [
            {"kind": "noop", "unique_key": "a"},  # held by the job above
            {"kind": "noop", "unique_key": "b"},
            {"kind": "noop", "unique_key": "b"},  # held by the item before
            {"kind": "noop"},
            {"kind": "noop"},
        ])
    assert inserted == 3
    with db.engine.connect() as conn:
        keys = sorted(str(k) for k in conn.execute(select(app.Job.unique_key)).scalars())
    assert keys == ["None", "None", "a", "b"]


def test_key_helper_and_bad_input() -> None:
    assert unique_key("charge", {"order": 42, "note": "x"}, ["order"]) == 'charge:{"order":42}'
    assert unique_key("charge", {"b": 1, "a": 2}) == unique_key("charge", {"a": 2, "b": 1})
    long = unique_key("charge", {"blob": "x" * 400})
    assert len(long) <= 255 and long.startswith("charge:sha256:")
    with pytest.raises(InvalidJob, match="no field"):
        unique_key("charge", {"a": 1}, ["order"])
    with pytest.raises(InvalidJob, match="must include 'pending' and 'running'"):
        app.Job(kind="noop", unique_key="k", unique_states=["pending"])
    with pytest.raises(InvalidJob, match="unknown state"):
        app.Job(kind="noop", unique_key="k", unique_states=["pending", "running", "dead"])
    with pytest.raises(InvalidJob, match="over the limit"):
        app.Job(kind="noop", unique_key="k" * 256)


def test_states_without_a_key_are_refused(db: Database) -> None:
    refused = pytest.raises(InvalidJob, match="without a unique_key")
    with refused, Session(db.engine) as session, session.begin():
        session.add(app.Job(kind="noop", unique_states=["pending", "running", "finished"]))
    with pytest.raises(InvalidJob, match="without a unique_key"), Session(db.engine) as session:
        app.queue.enqueue_many(session, [{"kind": "noop", "unique_states": ["pending", "running"]}])


# 8 threads in each of 2 processes enqueue the same key at once, each in a transaction that also
# writes a business row: exactly one job, and every transaction commits.
RACE = textwrap.dedent('''
    import os, sys, threading
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from tests import app

    engine = create_engine(os.environ["SQLA_JOBS_URL"], pool_size=8)
    start = threading.Barrier(8)
    results = []

    def caller(n):
        start.wait()
        with Session(engine) as session, session.begin():
            session.add(app.Once(job_id=int(sys.argv[1]) * 100 + n))
            results.append(app.queue.enqueue_unique(session, "noop", {}, unique_key="the-key").inserted)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(sum(results), len(results))
''')


def test_concurrent_callers_in_two_processes_get_one_row(db: Database) -> None:
    for _ in range(3):  # a few rounds: each one a fresh race on a free key
        procs = [forkserver.Popen([sys.executable, "-c", RACE, str(p)], env=db.env(), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in (1, 2)]
        outs = [p.communicate(timeout=120) for p in procs]
        for proc, (_, err) in zip(procs, outs, strict=True):
            assert proc.returncode == 0, err
        inserted = sum(int(out.split()[0]) for out, _ in outs)
        callers = sum(int(out.split()[1]) for out, _ in outs)
        assert (inserted, callers) == (1, 16)
        assert count(db.engine, app.Job) == 1 and count(db.engine, app.Once) == 16
        with db.engine.begin() as conn:
            conn.execute(text("DELETE FROM jobs"))
            conn.execute(text("DELETE FROM once"))


def test_jobs_list_filters_by_unique_key(db: Database) -> None:
    from tests.conftest import run_cli

    with Session(db.engine) as session, session.begin():
        app.queue.enqueue_unique(session, "noop", {}, unique_key="order-42")
        app.queue.enqueue_unique(session, "noop", {}, unique_key="order-42", unique_period=60)
        app.queue.enqueue_unique(session, "noop", {}, unique_key="order-420")
        app.queue.enqueue(session, "noop", {})
    result = run_cli("jobs", "list", "--app", "tests.app:queue", "--unique-key", "order-42", "--json", env=db.env())
    assert result.returncode == 0, result.stderr
    keys = sorted(job["unique_key"] for job in json.loads(result.stdout))
    assert len(keys) == 2 and keys[0] == "order-42" and keys[1].startswith("order-42@")
