"""Outcomes reported exactly as they happened, and charged to the job only when they are its own.

A transactional job whose transaction committed is reported finished (log,
``processed``, hooks, hence metrics), whatever a heartbeat running at the same
moment saw: the heartbeat must not take the job for lost because its own
worker just finished it.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import pytest
from sqlalchemy import create_engine, event, func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from sqla_jobs import JobEvent, Worker
from sqla_jobs.worker.outcomes import MAX_UNCOUNTED_OUTAGES
from tests import app
from tests.conftest import Database
from tests.helpers import run_burst

from .harness import check_invariants, dead, enqueue, states, terminate_backends, wait_for

pytestmark = pytest.mark.slow


def test_committed_transactional_jobs_are_all_reported_finished(db: Database) -> None:
    # A heartbeat every 20 ms while hundreds of transactional jobs commit: the race (a heartbeat between a
    # handler's commit and the control loop collecting its outcome) hit about a third of them before the
    # fix. The lease is long so that no lease runs out on a loaded machine (SQLite's write lock makes
    # heartbeats wait): every event but "finished" would then be a misreport.
    n, workers_n = 600, 3
    ids = enqueue(db.engine, "once", n=n)
    events: Counter[tuple[str, int]] = Counter()
    errors: dict[int, str | None] = {}
    lock = threading.Lock()

    def hook(event: JobEvent) -> None:
        with lock:
            events[(event.name, event.id)] += 1
            if event.name != "finished":
                errors[event.id] = event.error

    for name in ("finished", "lost", "failed", "dead_letter"):
        app.queue.on(name)(hook)
    engines = [create_engine(db.url, pool_size=8) for _ in range(workers_n)]
    pool = [Worker(e, app.queue, concurrency=4, lease=10, heartbeat=0.02, poll_interval=0.05, listen=False)
            for e in engines]
    try:
        runners = [threading.Thread(target=w.run, kwargs={"burst": True, "install_signals": False}) for w in pool]
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join(240)
        assert not any(r.is_alive() for r in runners), "a worker did not drain in time"
    finally:
        for name in ("finished", "lost", "failed", "dead_letter"):
            app.queue.off(name, hook)
        for e in engines:
            e.dispose()

    states = check_invariants(db.engine, ids)
    assert set(states.values()) == {"finished"}
    with db.engine.connect() as conn:
        once_rows = conn.execute(select(func.count()).select_from(app.Once)).scalar_one()
    assert once_rows == n, "every transactional job committed exactly once"
    finished = {job_id for (name, job_id) in events if name == "finished"}
    others = {key: count for key, count in events.items() if key[0] != "finished"}
    assert not others, (f"committed jobs reported as something else: {dict(list(others.items())[:10])}; "
                        f"errors: {dict(list(errors.items())[:3])}")
    assert len(finished) == n, f"{n - len(finished)} committed jobs were never reported finished"
    assert all(events[("finished", job_id)] == 1 for job_id in ids), "a job reported finished twice"
    assert sum(w.processed for w in pool) == n, "processed counts every committed job once"



def test_a_handler_failing_on_another_database_is_charged(pg: Database) -> None:
    """Only the queue database's outages are refunded: a handler that cannot reach its other database
    failed on its own, and with max_attempts=1 that is the end of it."""
    [job_id] = enqueue(pg.engine, "other_db_down", max_attempts=1)
    run_burst(pg.engine, listen=False)
    assert states(pg.engine, [job_id]) == {job_id: "dead"}
    row = dead(pg.engine, job_id)
    assert row.attempts == 1 and "OperationalError" in row.last_error
    assert "not counted" not in row.last_error


def test_queue_connection_dropped_under_a_handler_is_refunded_a_bounded_number_of_times(pg: Database) -> None:
    """The handler's session (the worker's engine) loses its server process: an outage of the queue
    database, so the attempt is refunded and the job runs again at once. A handler that does this every
    time is not retried forever: after MAX_UNCOUNTED_OUTAGES refunds its attempts count again."""
    [job_id] = enqueue(pg.engine, "kill_own_backend", max_attempts=1)
    run_burst(pg.engine, listen=False)
    assert states(pg.engine, [job_id]) == {job_id: "dead"}
    row = dead(pg.engine, job_id)
    uncounted = [e for e in row.errors if "attempt not counted" in e["error"]]
    assert len(uncounted) == MAX_UNCOUNTED_OUTAGES
    assert all(e["attempt"] == 1 for e in uncounted), "every refunded run was attempt 1"
    assert len(row.errors) == MAX_UNCOUNTED_OUTAGES + 1 and row.attempts == 1


def test_a_commit_whose_reply_was_lost_is_reported_finished(db: Database) -> None:
    """The transactional handler's commit applies, then the call fails (the reply never came back):
    the worker's fenced retry write finds the job finished under its own claim and says so."""
    [job_id] = enqueue(db.engine, "once", max_attempts=5)
    heard: list[tuple[str, int]] = []

    def hook(event: JobEvent) -> None:
        heard.append((event.name, event.id))

    def reply_lost(session: Session) -> None:
        raise OperationalError("COMMIT", {}, ConnectionError("the reply to COMMIT was lost"))

    for name in ("finished", "lost", "failed"):
        app.queue.on(name)(hook)
    event.listen(Session, "after_commit", reply_lost)
    try:
        worker = run_burst(db.engine, listen=False)
    finally:
        event.remove(Session, "after_commit", reply_lost)
        for name in ("finished", "lost", "failed"):
            app.queue.off(name, hook)
    assert check_invariants(db.engine, [job_id]) == {job_id: "finished"}
    assert heard == [("finished", job_id)] and worker.processed == 1


def test_jobs_a_cut_claim_left_the_worker_go_back_with_their_attempts_refunded(db: Database) -> None:
    """A claim can commit while its connection dies before the reply: the rows are the worker's, and it
    does not know them. Back from the outage it hands them back, uncharged (the scenario matrix's connection
    kills found them charged a lost attempt each, by the reaper, a lease later)."""
    ids = enqueue(db.engine, "noop", n=3)
    worker = Worker(db.engine, app.queue)
    store = worker._store
    driver = app.queue.driver(db.engine)
    with driver.write(db.engine) as conn:  # the claim whose reply was lost
        claimed, _ = driver.claim_batch(conn, 3, store.worker_name, "cut-claim", 60.0, None, False)
    assert len(claimed) == 3
    known = claimed[0].fence  # one the worker did hear of, running
    assert store.hand_back_strays([known]) == 2
    table = app.Job.__table__
    with db.engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(table.c.id, table.c.state, table.c.attempts)
                                             .where(table.c.id.in_(ids)))}
    assert rows[known[0]].state == "running"
    strays = [job.id for job in claimed[1:]]
    assert [(rows[i].state, rows[i].attempts) for i in strays] == [("pending", 0), ("pending", 0)]
    assert store.hand_back_strays([known]) == 0


def test_a_worker_back_from_an_outage_hands_back_what_a_cut_claim_left_it(pg: Database) -> None:
    """The control loop's side of the test above, on a running worker: rows claimed under its name that it
    never heard of (a claim whose reply the cut lost) wait for nobody's lease. The server cuts the worker's
    connections; back, the worker hands those rows back uncharged and runs them, long before their lease
    (60 s) would have let the reaper take them, charging an attempt."""
    ids = enqueue(pg.engine, "noop", n=2)
    engine = create_engine(pg.url)  # the worker's own: it names its connections, and those are cut
    worker = Worker(engine, app.queue, lease=60, poll_interval=0.1, listen=False)
    driver = app.queue.driver(pg.engine)
    with driver.write(pg.engine) as conn:
        claimed, _ = driver.claim_batch(conn, 2, worker.name, "reply-lost", 60.0, None, False)
    assert len(claimed) == 2
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    runner.start()
    try:
        # In its loop, its claim connection open (a fixed pause was too short on a loaded machine: the worker
        # opened that connection after the cut, saw no outage, and the strays waited for their lease).
        [warm] = enqueue(pg.engine, "noop")
        wait_for(lambda: states(pg.engine, [warm]).get(warm) == "finished", 20, "the worker to run a first job")
        assert terminate_backends(pg.engine, os.getpid()) >= 1  # the worker's connections, named by its pid
        wait_for(lambda: set(states(pg.engine, ids).values()) == {"finished"}, 20, "the stray jobs to run")
    finally:
        worker.stop()
        runner.join(30)
        engine.dispose()
    table = app.Job.__table__
    with pg.engine.connect() as conn:
        attempts = conn.execute(select(table.c.attempts).where(table.c.id.in_(ids))).scalars().all()
    assert attempts == [1, 1], "handed back with the attempt refunded, then run once"
