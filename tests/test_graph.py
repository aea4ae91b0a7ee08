"""Job graphs under real worker processes: a fan-in's join runs once, after every upstream finished by the
database clock, and reads their results in order; a chain runs link by link; a failed upstream cancels
its dependents. Four ``sqla-jobs worker`` processes share the work (tests/test_concurrency.py's harness)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tests import app
from tests.conftest import Database
from tests.test_concurrency import _run_burst_workers

pytestmark = pytest.mark.slow

FAN = 300


def _started(session: Session, job_id: int) -> list[object]:
    return list(session.scalars(select(app.Effect.at).where(app.Effect.job_id == job_id,
                                                            app.Effect.event == "start")))


@pytest.mark.parametrize("flavour", ["threaded", "async"])
def test_a_fan_in_joins_once_after_every_upstream_finished(db: Database, flavour: str) -> None:
    record, value, join = (("async_record", "result_async", "join_async") if flavour == "async"
                           else ("record", "result_value", "join"))
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        # Half the upstreams return a value (the transactional finish with results), half return None
        # (the worker's batched hot finish): the hand-off must hold on both paths.
        ups = [app.Job(kind=value if i % 2 else record, payload={"value": i}) for i in range(FAN)]
        last = app.Job(kind=join, payload={}, depends_on=ups)
        session.add(last)
    _run_burst_workers(db, flavour)
    with Session(db.engine) as session:
        states = Counter(session.scalars(select(app.Job.state)))
        starts = _started(session, last.id)
        latest = session.scalar(select(func.max(app.Job.finished_at)).where(app.Job.id != last.id))
        joined = session.get(app.Job, last.id)
        result, claimed, attempts = joined.result, joined.locked_at, joined.attempts
    assert states == {"finished": FAN + 1}
    assert len(starts) == 1 and attempts == 1, "the join ran more than once"
    assert claimed >= latest  # claimed after the last upstream finished, by the database clock
    expected = [({"async": i} if flavour == "async" else i) if i % 2 else None for i in range(FAN)]
    assert result == {"upstreams": expected}


def test_a_plain_handler_reads_its_upstreams_under_the_async_worker(db: Database) -> None:
    """The async worker runs a plain ``def`` handler on a thread; its ``upstream_results()`` reads through the
    worker's event loop (its engine is async)."""
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        ups = [app.Job(kind="result_value", payload={"value": i}) for i in range(3)]
        last = app.Job(kind="join", payload={}, depends_on=ups)
        session.add(last)
    _run_burst_workers(db, "async")
    with Session(db.engine) as session:
        assert session.get(app.Job, last.id).result == {"upstreams": [0, 1, 2]}


def test_a_chain_runs_link_by_link_across_processes(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        links = [app.Job(kind="record", payload={})]
        for _ in range(29):
            links.append(app.Job(kind="record", payload={}, depends_on=[links[-1]]))
        session.add_all(links)
    _run_burst_workers(db, "threaded")
    with Session(db.engine) as session:
        rows = {j.id: j for j in session.scalars(select(app.Job))}
        starts = {link.id: _started(session, link.id) for link in links}
    assert {r.state for r in rows.values()} == {"finished"}
    for before, after in pairwise(links):
        assert len(starts[after.id]) == 1 and rows[after.id].attempts == 1
        assert rows[after.id].locked_at >= rows[before.id].finished_at  # by the database clock


def test_a_dead_upstream_cancels_its_dependents_and_a_waiting_one_resumes_on_requeue(db: Database) -> None:
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        bad = app.Job(kind="fail", payload={}, max_attempts=1)
        cancelled = app.Job(kind="record", payload={}, depends_on=[bad])
        patient = app.Job(kind="record", payload={}, depends_on=[bad], on_upstream_failure="wait")
        anyway = app.Job(kind="join", payload={}, depends_on=[bad], on_upstream_failure="run")
        session.add_all([cancelled, patient, anyway])
    _run_burst_workers(db, "threaded")
    with Session(db.engine) as session:
        assert session.get(app.DeadJob, bad.id) is not None
        assert session.get(app.Job, cancelled.id).state == "cancelled"
        assert f"upstream job {bad.id} was dead-lettered" in session.get(app.Job, cancelled.id).last_error
        assert session.get(app.Job, patient.id).state == "blocked"
        assert session.get(app.Job, anyway.id).result == {"upstreams": [None]}
    with Session(db.engine) as session, session.begin():
        app.queue.requeue_dead(session, ids=[bad.id])
        session.get(app.Job, bad.id).kind = "record"  # fixed: it runs now
    _run_burst_workers(db, "threaded")
    with Session(db.engine) as session:
        assert session.get(app.Job, bad.id).state == "finished"
        assert session.get(app.Job, patient.id).state == "finished"
        assert len(_started(session, patient.id)) == 1


def test_a_dependent_is_not_left_blocked_when_its_upstream_finishes_between_the_flush_s_read_and_write(
        db: Database) -> None:
    """The flush marks the upstream first, then reads its state: the mark takes SQLite's write lock (the
    servers' row lock), so a worker cannot commit the upstream's finish between the read and the write. In
    the other order (read, then mark) a finish in between left the dependent counting a finished upstream."""
    import threading
    import time

    from sqlalchemy import create_engine, event

    from sqla_jobs import Worker

    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        up = app.Job(kind="gate", payload={"seconds": 20})
        session.add(up)
    app.GATE.clear()
    worker_engine = create_engine(db.url)
    worker = threading.Thread(target=lambda: Worker(worker_engine, app.queue, poll_interval=0.05, listen=False)
                              .run(burst=True, install_signals=False))
    worker.start()
    try:
        deadline = time.monotonic() + 20
        while _state(db, up.id) != "running" and time.monotonic() < deadline:
            time.sleep(0.02)
        adder = create_engine(db.url)

        @event.listens_for(adder, "after_cursor_execute")
        def let_the_worker_finish(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "jobs.state" in statement and "FROM jobs" in statement and not app.GATE.is_set():
                app.GATE.set()  # the upstream's handler returns; its finish commits unless the flush holds a lock
                until = time.monotonic() + 2
                while _state(db, up.id) != "finished" and time.monotonic() < until:
                    time.sleep(0.02)

        with Session(adder, expire_on_commit=False) as session, session.begin():
            dependent = app.Job(kind="noop", payload={}, depends_on=[up.id])
            session.add(dependent)
        assert app.GATE.is_set(), "the flush did not read the upstream's state"
    finally:
        app.GATE.set()
        worker.join(30)
        worker_engine.dispose()
    Worker(db.engine, app.queue, poll_interval=0.05, listen=False).run(burst=True, install_signals=False)
    assert (_state(db, up.id), _state(db, dependent.id)) == ("finished", "finished")


def _state(db: Database, job_id: int) -> str | None:
    with Session(db.engine) as session:
        return session.scalar(select(app.Job.state).where(app.Job.id == job_id))


def test_an_unblocked_job_wakes_a_listening_worker_at_once(pg: Database) -> None:
    """PostgreSQL: the transaction that counts a dependent down to 0 notifies the listening workers, so one that
    polls only every 30 s runs the dependent at once (point 2 of issue 33)."""
    import threading
    import time

    from sqla_jobs import Worker

    app.queue.create_tables(pg.engine)
    worker = Worker(pg.engine, app.queue, concurrency=2, poll_interval=30, listen=True)
    thread = threading.Thread(target=lambda: worker.run(install_signals=False))
    thread.start()
    try:
        time.sleep(1.0)  # listening
        with Session(pg.engine, expire_on_commit=False) as session, session.begin():
            first = app.Job(kind="noop", payload={})
            second = app.Job(kind="noop", payload={}, depends_on=[first])
            session.add(second)
        began = time.monotonic()
        while _state(pg, second.id) != "finished" and time.monotonic() - began < 15:
            time.sleep(0.05)
        waited = time.monotonic() - began
    finally:
        worker.stop()
        thread.join(30)
    assert _state(pg, second.id) == "finished" and waited < 10, f"the dependent waited {waited:.1f}s for a poll"
