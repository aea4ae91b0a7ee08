"""sqla_jobs.testing: the helpers users put in their own test suites, on both backends."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs import Backoff, ConfigError, DeadJobMixin, JobMixin, JobQueue
from sqla_jobs.testing import JobsFailed, assert_enqueued, eager, make_due, run_due
from tests.conftest import Database


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "tk_jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "tk_dead_jobs"


# A real backoff (a minute): a failed run waits, as in production, until make_due.
queue: JobQueue[Job, DeadJob] = JobQueue(Job, DeadJob, backoff=Backoff(base=60, jitter=0))
done: list[Any] = []


@queue.handler("ok")
def ok(payload: dict[str, Any]) -> None:
    done.append(payload["n"])


@queue.handler("broken")
def broken(payload: dict[str, Any]) -> None:
    raise ValueError(f"cannot do {payload['n']}")


@queue.handler("chain")
def chain(payload: dict[str, Any]) -> None:
    from tests.test_testing import _engine  # the handler's own session, as an app's would be

    with Session(_engine) as session, session.begin():
        session.add(Job(kind="ok", payload={"n": payload["n"] + 1}))


_engine: Any = None


@pytest.fixture
def tdb(db: Database) -> Database:
    global _engine
    queue.create_tables(db.engine)
    done.clear()
    _engine = db.engine
    return db


def add(engine: Any, *jobs: Job) -> list[int]:
    with Session(engine) as session, session.begin():
        session.add_all(jobs)
        session.flush()
        return [j.id for j in jobs]


def test_run_due_reports_finished_failed_and_dead_with_errors(tdb: Database) -> None:
    good, bad = add(tdb.engine, Job(kind="ok", payload={"n": 1}), Job(kind="broken", payload={"n": 2}, max_attempts=2))
    first = run_due(tdb.engine, queue)
    assert [e.id for e in first.finished] == [good] and done == [1]
    assert [(e.id, e.attempt) for e in first.failed] == [(bad, 1)] and first.dead == []
    assert first.errors == [first.failed[0].error] and "ValueError: cannot do 2" in first.errors[0]
    with pytest.raises(JobsFailed, match=r"job \d+ 'broken' attempt 1: failed: .*cannot do 2"):
        first.raise_errors()
    # The retry waits out its minute of backoff: another run finds nothing due.
    assert run_due(tdb.engine, queue).events == []
    assert make_due(tdb.engine, queue) == 1
    last = run_due(tdb.engine, queue)
    assert [(e.id, e.attempt) for e in last.dead] == [(bad, 2)] and "cannot do 2" in (last.dead[0].error or "")
    with Session(tdb.engine) as session:
        assert session.get(DeadJob, bad) is not None and session.get(Job, bad) is None
        assert session.get(Job, good).state == "finished"  # type: ignore[union-attr]
    assert run_due(tdb.engine, queue).raise_errors().events == []


def test_make_due_moves_only_later_jobs_by_the_database_clock(tdb: Database) -> None:
    later = datetime.now(timezone.utc) + timedelta(days=1)
    add(tdb.engine, Job(kind="ok", payload={"n": 1}, run_at=later), Job(kind="broken", payload={"n": 2}, run_at=later))
    assert run_due(tdb.engine, queue).events == []
    with Session(tdb.engine) as session, session.begin():
        assert make_due(session, queue, kind="ok") == 1  # in the caller's transaction
    assert make_due(tdb.engine, queue, kind="ok") == 0  # due already: not moved again
    assert [e.kind for e in run_due(tdb.engine, queue).finished] == ["ok"] and done == [1]
    with Session(tdb.engine) as session:
        run_at = session.scalar(select(Job.run_at).where(Job.kind == "broken"))
    assert run_at is not None and run_at.replace(tzinfo=timezone.utc) > datetime.now(timezone.utc)


def test_assert_enqueued_in_a_session_and_in_the_database(tdb: Database) -> None:
    with Session(tdb.engine) as session, session.begin():
        session.add(Job(kind="ok", payload={"n": 7, "to": "a@example.com"}))  # not flushed yet
        [job] = assert_enqueued(session, queue, "ok", {"to": "a@example.com"})
        assert job.payload["n"] == 7
        assert_enqueued(session, queue, "ok", lambda p: p["n"] > 5, count=1)
        assert_enqueued(session, queue, "ok", {"to": "b@example.com"}, count=0)
        with pytest.raises(AssertionError, match=r"expected a 'ok' job matching \{'to': 'b@example.com'\}, found 0"):
            assert_enqueued(session, queue, "ok", {"to": "b@example.com"})
        with pytest.raises(AssertionError, match="no job of that kind"):
            assert_enqueued(session, queue, "broken")
    assert_enqueued(tdb.engine, queue, "ok", {"n": 7}, state="pending")
    with tdb.engine.connect() as conn:
        assert_enqueued(conn, queue, "ok", count=1)
    run_due(tdb.engine, queue)
    with pytest.raises(AssertionError, match="found 0"):
        assert_enqueued(tdb.engine, queue, "ok", state="pending")
    assert_enqueued(tdb.engine, queue, "ok", {"n": 7}, state="finished")


def test_eager_runs_committed_jobs_at_commit_and_nothing_else(tdb: Database) -> None:
    with eager(queue) as reports:
        with Session(tdb.engine) as session:
            session.add(Job(kind="ok", payload={"n": 1}))
            session.commit()
            assert done == [1]  # ran before commit() returned
            session.add(Job(kind="ok", payload={"n": 2}))
            session.flush()
            session.rollback()  # never existed, never runs
            session.add(Job(kind="chain", payload={"n": 10}))  # its handler commits a follow-up job
            session.commit()
        assert done == [1, 11] and [len(r.finished) for r in reports] == [1, 2]
        with Session(tdb.engine) as session:
            session.add(Job(kind="broken", payload={"n": 3}, max_attempts=1))
            with pytest.raises(JobsFailed, match="cannot do 3"):
                session.commit()
        with Session(tdb.engine) as session:
            assert session.scalar(select(DeadJob.kind)) == "broken"  # the commit itself stood
    with Session(tdb.engine) as session, session.begin():
        session.add(Job(kind="ok", payload={"n": 4}))
    assert done == [1, 11]  # outside eager a worker is needed again
    assert [e.kind for e in run_due(tdb.engine, queue).finished] == ["ok"] and done == [1, 11, 4]


_memory = None


def _memory_engine() -> Any:
    global _memory
    if _memory is None:
        from sqlalchemy import create_engine

        _memory = create_engine("sqlite://")
        queue.create_tables(_memory)
    return _memory


# Text that payload validation accepts (no NUL, no lone surrogates): the matching is under test here.
words = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=5)
scalars = st.one_of(st.integers(-(2**53), 2**53), words, st.booleans(), st.none())


@given(payload=st.dictionaries(words.filter(bool), scalars, max_size=6), data=st.data())
@settings(max_examples=60, deadline=None)
def test_a_dict_matches_exactly_the_payloads_holding_its_items(payload: dict[str, Any], data: Any) -> None:
    subset = {k: payload[k] for k in data.draw(st.lists(st.sampled_from(sorted(payload)), unique=True))} \
        if payload else {}
    with Session(_memory_engine()) as session:
        session.add(Job(kind="ok", payload=payload))  # never flushed: nothing is written
        assert len(assert_enqueued(session, queue, "ok", subset)) == 1
        extra = data.draw(words.filter(lambda k: k and k not in payload))
        assert_enqueued(session, queue, "ok", {**subset, extra: 1}, count=0)
        if subset:
            key = sorted(subset)[0]
            assert_enqueued(session, queue, "ok", {**subset, key: ["not", "equal"]}, count=0)


def test_eager_with_sessions_bound_to_a_connection_needs_the_engine(tdb: Database) -> None:
    with tdb.engine.connect() as conn:
        with eager(queue), Session(bind=conn) as session:
            session.add(Job(kind="ok", payload={"n": 1}))
            with pytest.raises(ConfigError, match=r"pass eager\(queue, engine=\.\.\.\)"):
                session.commit()
        assert done == []
        with eager(queue, engine=tdb.engine), Session(bind=conn) as session:
            session.add(Job(kind="ok", payload={"n": 2}))
            session.commit()
        assert sorted(done) == [1, 2]  # the first job was committed all the same, and ran now
