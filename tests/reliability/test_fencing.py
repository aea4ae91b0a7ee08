"""Fencing: a worker that lost its claim changes nothing; the reaper and a completion never both win.

Also the per-kind timeout, whose abandoned run is fenced off the same way.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, make_url, text, update

from sqla_jobs import Worker
from sqla_jobs.drivers.postgresql.keepalive import SERVER_SIDE
from tests import app
from tests.conftest import Database

from .conftest import Workers, via
from .harness import REAP_LEASE, all_settled, check_invariants, dead, effects, enqueue, job, states, wait_for
from .proxy import TcpProxy

pytestmark = pytest.mark.slow


def claim_one(db: Database, lease: float = 60.0) -> tuple[int, str]:
    """Claim as an idle worker does, so a job the reaper marked for isolation is taken too."""
    sql = app.queue.driver(db.engine)
    token = uuid.uuid4().hex
    with sql.write(db.engine) as conn:
        [claimed] = sql.claim(conn, 1, "test", token, lease, None, alone=True)
    return claimed.fence


def expire(db: Database, job_id: int) -> None:
    """Move a lease into the past with the database's own clock arithmetic."""
    sql = app.queue.driver(db.engine)
    with db.engine.begin() as conn:
        conn.execute(update(app.Job).where(app.Job.id == job_id).values(lease_expires_at=sql.later(-5)))




def test_stale_worker_result_is_discarded_not_applied(pg: Database, workers: Workers, proxy: TcpProxy) -> None:
    """Worker A is cut off (stalled, not closed) mid-job; B takes over after the lease; A's late finish is fenced.

    A comes back while B is still running the job: a finish fenced by job id
    alone would mark B's run finished under it.
    """
    [job_id] = enqueue(pg.engine, "relay", {"first": 0.3, "later": 3.0})
    stale = workers(via(proxy, pg), handler_url=pg.url, no_listen=True)
    wait_for(lambda: effects(pg.engine, job_id, "start"), 30, "A to start the job")
    proxy.stall()
    wait_for(lambda: effects(pg.engine, job_id, "finish"), 30, "A's handler to finish (its result held back)")
    rescuer = workers(pg.url)
    wait_for(lambda: len(effects(pg.engine, job_id, "start")) == 2, 30, "B to take the job over")
    proxy.resume()
    wait_for(lambda: "result discarded" in stale.log(), 30, "A to discard its stale result")
    row = job(pg.engine, job_id)
    assert (row.state, row.attempts) == ("running", 2), "A's stale finish must not touch B's run"
    wait_for(lambda: all_settled(pg.engine, [job_id]), 30, "B to finish the job")
    assert stale.alive() and rescuer.alive()
    assert stale.stop() == 0 and rescuer.stop() == 0
    check_invariants(pg.engine, [job_id], workers.logs())
    row = job(pg.engine, job_id)
    assert (row.state, row.attempts) == ("finished", 2)
    assert "WorkerLost" in row.errors[0]["error"]
    assert f"job {job_id} relay attempt 1/" in stale.log() and "claim lost" in stale.log()
    assert f"job {job_id} relay attempt 2/5" in rescuer.log() and "finished" in rescuer.log()


def test_a_silently_partitioned_worker_stops_its_handlers_before_another_takes_over(
    pg: Database, workers: Workers, proxy: TcpProxy, tmp_path: Path
) -> None:
    """Issue 32: the link under worker A stalls (packets dropped, no reset) while its three handlers run. A stops
    them within 2/3 of its lease, before B takes the jobs over when the lease has run out, so no job ever runs
    twice at once; when the link heals A reports nothing stale, hands back what is still its own, and works on."""
    runs = tmp_path / "runs"
    payload = {"first": 60, "later": 0.2, "runs": str(runs)}
    ids = enqueue(pg.engine, "patient", payload, n=3)
    timing = {"lease": 6, "heartbeat": 1}  # margins that hold on a loaded machine: A stops at 4 s, B starts after 6
    a = workers(via(proxy, pg), handler_url=pg.url, no_listen=True, concurrency=3, **timing)
    wait_for(lambda: list(states(pg.engine, ids).values()).count("running") == 3, 30, "A to run the three jobs")
    proxy.stall()
    b = workers(pg.url, concurrency=3, **timing)
    wait_for(lambda: all_settled(pg.engine, ids), 60, "B to take the jobs over and finish them")
    wait_for(lambda: runs.read_text().count("cancelled") == 3, 10, "A's handlers to have stopped")
    proxy.resume()
    wait_for(lambda: "answers again" in a.log(), 30, "A to reach the database again")
    assert b.stop() == 0
    more = enqueue(pg.engine, "patient", {**payload, "first": 0.2}, n=3)
    wait_for(lambda: all_settled(pg.engine, more), 30, "A to run the next jobs")
    assert a.alive()
    assert a.stop() == 0
    check_invariants(pg.engine, ids + more, workers.logs())
    lines = [line.split() for line in runs.read_text().splitlines()]
    for job_id in ids:
        mine = sorted((int(att), float(start), float(end), how) for jid, att, _, start, end, how in lines
                      if int(jid) == job_id)
        assert [(att, how) for att, _, _, how in mine] == [(1, "cancelled"), (2, "done")], mine
        assert mine[0][2] < mine[1][1], f"job {job_id}: A's run ended after B's began: {mine}"
    assert "stopped 3 running job(s)" in a.log()
    assert {int(line[2]) for line in lines if int(line[0]) in more} == {a.pid}, "A did not claim again"


def stale_writes_change_nothing(db: Database, job_id: int, fence: tuple[int, str]) -> None:
    before = job(db.engine, job_id)
    sql = app.queue.driver(db.engine)
    with sql.write(db.engine) as conn:
        assert sql.finish(conn, [fence]) == set()
        assert sql.heartbeat(conn, [fence], 60) == set()
        assert not sql.release(conn, fence, error="stale", attempt=1)
        assert not sql.release(conn, fence, refund=True)
        assert not sql.dead_letter(conn, fence, "stale")
    assert job(db.engine, job_id) == before
    assert not dead(db.engine, job_id)


def test_a_stale_token_never_changes_a_row(db: Database, workers: Workers) -> None:
    """Deterministic: claim, expire, reap, re-claim (still running), then write with the old token; again after a
    real worker re-ran the job."""
    [job_id] = enqueue(db.engine, "record", max_attempts=5)
    first = claim_one(db)
    expire(db, job_id)
    Worker(db.engine, app.queue, lease=REAP_LEASE)._reap()
    second = claim_one(db)
    assert job(db.engine, job_id).claim_token == second[1]
    stale_writes_change_nothing(db, job_id, first)

    expire(db, job_id)
    worker = workers(db.url)
    wait_for(lambda: all_settled(db.engine, [job_id]), 30, "the worker to reap and re-run the job")
    assert worker.stop() == 0
    assert job(db.engine, job_id).attempts == 3
    stale_writes_change_nothing(db, job_id, first)
    stale_writes_change_nothing(db, job_id, second)
    check_invariants(db.engine, [job_id], workers.logs())


def test_reaper_never_touches_a_live_lease(db: Database) -> None:
    [job_id] = enqueue(db.engine, "record", max_attempts=1)
    fence = claim_one(db, lease=60)
    Worker(db.engine, app.queue, lease=REAP_LEASE)._reap()
    assert job(db.engine, job_id).state == "running" and not dead(db.engine, job_id)
    expire(db, job_id)
    Worker(db.engine, app.queue, lease=REAP_LEASE)._reap()
    assert "WorkerLost" in dead(db.engine, job_id).last_error, "last attempt lost: dead-lettered, not re-run"
    sql = app.queue.driver(db.engine)
    with sql.write(db.engine) as conn:
        assert sql.finish(conn, [fence]) == set()
    check_invariants(db.engine, [job_id])


def sqlite_file(tmp_path: Path) -> Database:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = create_engine(url)
    app.queue.create_tables(engine)
    app.Base.metadata.create_all(engine)
    return Database("sqlite", url, engine)


def test_reaper_that_waited_for_sqlites_write_lock_looks_again_next_turn(tmp_path: Path) -> None:
    """Whoever held SQLite's write lock while the reaper waited was alive, and may be the worker whose lease
    ran out while it was frozen with the lock in hand: reaped the moment it let go, its handler would run on
    beside the retry (the matrix's stale-worker scenario shows how a resumed handler runs on). A reaper that
    waited a third of a lease hands back nothing; its next turn, without the wait, does."""
    db = sqlite_file(tmp_path)
    url, engine = db.url, db.engine
    [job_id] = enqueue(engine, "record", max_attempts=3)
    claim_one(db, lease=60)
    expire(db, job_id)
    worker = Worker(engine, app.queue, lease=1.5)
    holder = create_engine(url).connect()
    holder.exec_driver_sql("BEGIN IMMEDIATE")  # a frozen worker's write transaction, lock held
    reaper = threading.Thread(target=worker._reap)
    reaper.start()
    time.sleep(1.0)  # the reaper waits for the lock past 0.5 s, a third of its lease
    holder.rollback()
    holder.close()
    reaper.join(30)
    assert job(engine, job_id).state == "running", "reaped right after waiting out the lock's holder"
    worker._reap()
    assert job(engine, job_id).state == "pending" and job(engine, job_id).attempts == 1
    engine.dispose()


def test_a_reaper_whose_own_write_waited_out_the_lease_gives_the_others_a_lease_to_renew(tmp_path: Path) -> None:
    """The write lock held past the lease (a backup, a long migration: the matrix's SQLite outage): every worker's
    writes waited, and whichever gets the lock first must not reap the others, whose leases ran out while they
    waited their turn. The reaper's own transaction does not wait then (its heartbeat did), so its patience does
    not see it; the wait of any write of this worker's keeps it away for a lease, after which it reaps."""
    db = sqlite_file(tmp_path)
    url, engine = db.url, db.engine
    [job_id] = enqueue(engine, "record", max_attempts=3)
    claim_one(db, lease=1.5)  # another worker's run, alive but waiting for the lock too
    worker = Worker(engine, app.queue, lease=1.5)
    holder = create_engine(url).connect()
    holder.exec_driver_sql("BEGIN IMMEDIATE")
    heartbeat = threading.Thread(target=worker._store.heartbeat, args=([(job_id, "not-ours")],))
    heartbeat.start()
    time.sleep(2.0)  # past the other run's lease
    holder.rollback()
    holder.close()
    heartbeat.join(30)
    worker._reap()
    assert job(engine, job_id).state == "running", "reaped a worker that was waiting for the lock like this one"
    time.sleep(1.6)
    worker._reap()
    assert job(engine, job_id).state == "pending" and job(engine, job_id).attempts == 1
    engine.dispose()


def test_reaper_racing_a_completion_only_one_wins(pg: Database) -> None:
    """Both orders, with real row locks held open: the loser's write changes nothing."""
    sql = app.queue.driver(pg.engine)
    # 1. The completion holds the row: the reaper skips it; the completion commits.
    [first] = enqueue(pg.engine, "noop")
    fence = claim_one(pg)
    expire(pg, first)
    with pg.engine.connect() as finishing:
        assert sql.finish(finishing, [fence]) == {first}  # row locked, not committed yet
        reaper = threading.Thread(target=Worker(pg.engine, app.queue)._reap)
        reaper.start()
        reaper.join(10)
        assert not reaper.is_alive(), "the reaper must skip a locked row, not wait for it"
        finishing.commit()
    assert job(pg.engine, first).state == "finished"

    # 2. The reaper holds the row: the completion waits, then finds the claim gone.
    [second] = enqueue(pg.engine, "noop")
    fence = claim_one(pg)
    expire(pg, second)
    outcome: list[set[int]] = []

    def finish() -> None:
        with sql.write(pg.engine) as conn:
            outcome.append(sql.finish(conn, [fence]))

    with sql.write(pg.engine) as reaping:
        [row] = sql.expired(reaping)
        assert sql.release(reaping, (row.id, row.claim_token), error="WorkerLost: test", attempt=row.attempts)
        finisher = threading.Thread(target=finish)
        finisher.start()
        finisher.join(0.5)
        assert finisher.is_alive(), "the completion must wait for the reaper's lock"
    finisher.join(10)
    assert outcome == [set()], "the completion lost the race and changed nothing"
    assert job(pg.engine, second).state == "pending"
    check_invariants(pg.engine, [first, second])


def test_hanging_handler_times_out_and_its_late_result_is_fenced(db: Database, workers: Workers) -> None:
    [job_id] = enqueue(db.engine, "hang", {"seconds": 2.0}, max_attempts=2)
    worker = workers(db.url, concurrency=2)
    wait_for(lambda: dead(db.engine, job_id), 30, "two timeouts to dead-letter the job")
    row = dead(db.engine, job_id)
    assert "TimeoutError" in row.last_error and row.attempts == 2
    assert [e["error"].split(":")[0] for e in row.errors] == ["TimeoutError", "TimeoutError"]
    wait_for(lambda: worker.log().count("result (ok) discarded") == 2, 30, "the hung handlers to return")
    assert len(effects(db.engine, job_id, "finish")) == 2  # they did finish, late: their side effects happened
    assert worker.stop() == 0
    check_invariants(db.engine, [job_id], workers.logs())


def test_worker_connections_carry_keepalives_and_a_name(pg: Database, workers: Workers) -> None:
    worker = workers(pg.url)
    wait_for(lambda: "started" in worker.log(), 30, "the worker to start")
    with pg.engine.connect() as conn:
        names = wait_for(lambda: conn.execute(text(
            "select application_name from pg_stat_activity where application_name like :p"),
            {"p": f"sqla-jobs worker %:{worker.pid}:%"}).scalars().all(), 10, "the worker's connections")
    assert names
    assert worker.stop() == 0


def test_worker_connections_detect_a_dead_peer(pg: Database) -> None:
    """Client and server keepalives and timeouts are on, so a silent network death ends in an error, not a hang."""
    engine = create_engine(make_url(pg.url).update_query_dict({"keepalives_idle": "30"}))
    try:
        Worker(engine, app.queue, name="keepalive-test")
        with engine.connect() as conn:
            params = conn.connection.driver_connection.info.get_parameters()
            server = {name: conn.execute(text(f"show {name}")).scalar_one() for name in SERVER_SIDE}
            schema = conn.execute(text("show search_path")).scalar_one()
        assert params["keepalives"] == "1" and params["tcp_user_timeout"] == "30000"
        assert params["connect_timeout"] == "10"
        assert params["keepalives_idle"] == "30", "a value given in the URL wins"
        assert params["application_name"] == "sqla-jobs worker keepalive-test"
        assert server == {"tcp_keepalives_idle": "10", "tcp_keepalives_interval": "5",
                          "tcp_keepalives_count": "3", "tcp_user_timeout": "30000"}
        assert schema == pg.schema, "the URL's own options are kept"
    finally:
        engine.dispose()
