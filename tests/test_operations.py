"""Steering the queue: cancel, retry now, dead-letter admin, pruning, health, from Python and the CLI."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, func, select, update
from sqlalchemy.orm import Session

from sqla_jobs import JobStateError, NotFound, Worker
from sqla_jobs.errors import ConfigError
from tests import forkserver
from tests.app import DeadJob, Effect, Job, queue
from tests.conftest import ROOT, Database, run_cli
from tests.helpers import run_burst
from tests.test_stats import add_dead, add_jobs, build_known_table, db_now, finished

APP = ("--app", "tests.app:queue")


def enqueue(db: Database, kind: str = "noop", **fields: Any) -> int:
    with Session(db.engine) as session, session.begin():
        job = queue.enqueue(session, kind, fields.pop("payload", {}), **fields)
        session.flush()
        return job.id


def job_row(db: Database, job_id: int) -> Any:
    with Session(db.engine) as session:
        return queue.get_job(session, job_id)


def effects(db: Database, job_id: int) -> list[str]:
    with Session(db.engine) as session:
        return list(session.scalars(select(Effect.event).where(Effect.job_id == job_id).order_by(Effect.id)))


def burst(db: Database, **kw: Any) -> None:
    Worker(db.engine, queue, poll_interval=0.05, **kw).run(burst=True, install_signals=False)


# -- cancel -------------------------------------------------------------------------


def test_cancelled_pending_job_never_runs(db: Database) -> None:
    job_id = enqueue(db, "record")
    with Session(db.engine) as session, session.begin():
        assert queue.cancel(session, job_id) == "cancelled"
    burst(db)
    row = job_row(db, job_id)
    assert (row.state, row.attempts) == ("cancelled", 0)
    assert row.cancelled_at is not None and row.finished_at is not None
    assert effects(db, job_id) == []
    with Session(db.engine) as session, session.begin(), pytest.raises(JobStateError, match="cancelled already"):
        queue.cancel(session, job_id)
    with Session(db.engine) as session, session.begin(), pytest.raises(NotFound, match="no job with id 424242"):
        queue.cancel(session, 424242)


def _start_worker(db: Database, *extra: str) -> forkserver.Popen:
    return forkserver.Popen(
        [sys.executable, "-m", "sqla_jobs.cli", "worker", *APP, "--poll-interval", "0.05", *extra],
        env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _stop(proc: forkserver.Popen) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.mark.parametrize(("fail", "max_attempts", "end_state"),
                         [(True, 5, "cancelled"), (True, 1, "cancelled"), (False, 5, "finished")])
def test_cancel_a_running_job_is_honoured_at_its_end(db: Database, fail: bool, max_attempts: int,
                                                      end_state: str) -> None:
    """A request that has not reached the handler yet: a failing run ends cancelled (no retry, and no
    dead letter even on its last attempt); a run that succeeds stays finished, with cancelled_at kept."""
    job_id = enqueue(db, "await_cancel", payload={"fail": fail}, max_attempts=max_attempts)
    # No LISTEN: the request then reaches the worker only at its next heartbeat (20 s away), after the
    # handler saw it in the table and ended; the case where it does reach the handler: test_cancel_running.py.
    worker = _start_worker(db, "--no-listen")
    try:
        _wait_for(lambda: effects(db, job_id) == ["start"])
        result = run_cli("jobs", "cancel", str(job_id), *APP, env=db.env())
        assert result.returncode == 0, result.stderr
        assert "is running: cancel requested" in result.stdout
        _wait_for(lambda: job_row(db, job_id).state not in ("pending", "running"))
    finally:
        _stop(worker)
    row = job_row(db, job_id)
    assert row.state == end_state
    assert row.attempts == 1  # never retried
    assert row.cancelled_at is not None
    with Session(db.engine) as session:
        assert session.scalar(select(func.count()).select_from(DeadJob)) == 0


def test_cli_cancel_errors(db: Database) -> None:
    result = run_cli("jobs", "cancel", "777", *APP, env=db.env())
    assert result.returncode == 2 and result.stderr.strip() == "sqla-jobs: no job with id 777"
    add_dead(db.engine, [{"id": 778, "failed_at": db_now(db.engine)}])
    result = run_cli("jobs", "cancel", "778", *APP, env=db.env())
    assert result.returncode == 2 and "dead-letter table: see `sqla-jobs dead show 778`" in result.stderr


# -- retry now ------------------------------------------------------------------------


def test_retry_now_makes_a_scheduled_job_run(db: Database) -> None:
    job_id = enqueue(db, "record", run_at=db_now(db.engine) + timedelta(hours=2))
    burst(db)
    assert effects(db, job_id) == []  # not due
    result = run_cli("jobs", "retry", str(job_id), *APP, env=db.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"job {job_id} is due now"
    burst(db)
    assert effects(db, job_id) == ["start", "finish"]
    assert job_row(db, job_id).state == "finished"
    with Session(db.engine) as session, session.begin(), pytest.raises(JobStateError, match="is finished"):
        queue.retry_now(session, job_id)
    with Session(db.engine) as session, session.begin(), pytest.raises(NotFound):
        queue.retry_now(session, 999_999)


# -- jobs list / show ---------------------------------------------------------------------


def test_jobs_list_filters_and_show(db: Database) -> None:
    build_known_table(db.engine)
    mail = enqueue(db, "flaky", queue="mail", payload={"succeed_on": 2})

    result = run_cli("jobs", "list", *APP, "--json", env=db.env())
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 18 and rows[0]["id"] == mail  # newest first

    result = run_cli("jobs", "list", *APP, "--state", "running", "--json", env=db.env())
    assert sorted(r["state"] for r in json.loads(result.stdout)) == ["running", "running"]
    result = run_cli("jobs", "list", *APP, "--kind", "a", "--state", "finished", "--limit", "3", "--json",
                     env=db.env())
    got = json.loads(result.stdout)
    assert len(got) == 3 and {(r["kind"], r["state"]) for r in got} == {("a", "finished")}
    result = run_cli("jobs", "list", *APP, "--queue", "mail", env=db.env())
    assert result.returncode == 0 and "flaky" in result.stdout and "mail" in result.stdout
    result = run_cli("jobs", "list", *APP, "--state", "bogus", env=db.env())
    assert result.returncode == 2 and "invalid choice" in result.stderr

    # a failed attempt, then show: every field, the payload, the error history
    Worker(db.engine, queue, poll_interval=0.05, queues=["mail"]).run(burst=True, install_signals=False)
    result = run_cli("jobs", "show", str(mail), *APP, env=db.env())
    assert result.returncode == 0, result.stderr
    for needle in ("state ", "claim_token", "payload", '"succeed_on": 2', "errors (1):",
                   "attempt 1 at", "ConnectionError: attempt 1 failed"):
        assert needle in result.stdout, needle
    data = json.loads(run_cli("jobs", "show", str(mail), *APP, "--json", env=db.env()).stdout)
    assert data["payload"] == {"succeed_on": 2} and len(data["errors"]) == 1
    assert run_cli("jobs", "show", "31337", *APP, env=db.env()).returncode == 2


# -- dead-letter admin --------------------------------------------------------------------


def test_dead_admin_list_since_show_retry_purge(db: Database) -> None:
    now = db_now(db.engine)
    add_dead(db.engine, [
        {"id": 501, "kind": "noop", "failed_at": now - timedelta(days=40)},
        {"id": 502, "kind": "noop", "failed_at": now - timedelta(hours=3)},
        {"id": 503, "kind": "record", "failed_at": now - timedelta(minutes=5), "payload": {"order": 7},
         "errors": [{"attempt": 1, "at": "t1", "error": "ValueError: first"},
                    {"attempt": 2, "at": "t2", "error": "ValueError: second"}]},
    ])
    listed = json.loads(run_cli("dead", "list", *APP, "--json", env=db.env()).stdout)
    assert [r["id"] for r in listed] == [503, 502, 501]
    listed = json.loads(run_cli("dead", "list", *APP, "--since", "1h", "--json", env=db.env()).stdout)
    assert [r["id"] for r in listed] == [503]
    listed = json.loads(run_cli("dead", "list", *APP, "--kind", "noop", "--since", "1d", "--json",
                                env=db.env()).stdout)
    assert [r["id"] for r in listed] == [502]
    assert run_cli("dead", "list", *APP, "--since", "soon", env=db.env()).returncode == 2
    table = run_cli("dead", "list", *APP, "--since", "1d", env=db.env()).stdout
    assert "2 dead job(s)" in table and "503" in table and "502" in table and "501" not in table
    assert "ValueError: boom" in table

    shown = run_cli("dead", "show", "503", *APP, env=db.env())
    assert shown.returncode == 0, shown.stderr
    assert '"order": 7' in shown.stdout and "errors (2):" in shown.stdout
    assert "attempt 1 at t1: ValueError: first" in shown.stdout
    assert "attempt 2 at t2: ValueError: second" in shown.stdout
    missing = run_cli("dead", "show", "1", *APP, env=db.env())
    assert missing.returncode == 2 and "no dead job with id 1" in missing.stderr

    purged = run_cli("dead", "purge", *APP, "--older-than", "30d", env=db.env())
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.startswith("purged 1 dead job(s)")
    with Session(db.engine) as session, session.begin():
        assert queue.purge_dead(session, older_than=3600, kind="record") == 0  # 503 is 5 minutes old
        assert [r.id for r in queue.list_dead(session)] == [503, 502]

    retried = run_cli("dead", "retry", "503", *APP, env=db.env())
    assert retried.returncode == 0 and "requeued 1 job(s): 503" in retried.stdout
    burst(db)
    assert effects(db, 503) == ["start", "finish"]
    retried = run_cli("dead", "retry", *APP, "--all", env=db.env())
    assert "requeued 1 job(s): 502" in retried.stdout
    assert run_cli("dead", "retry", "503", *APP, env=db.env()).returncode == 2  # not dead any more


# -- prune --------------------------------------------------------------------------------


def _count(db: Database, *where: Any) -> int:
    with Session(db.engine) as session:
        return session.scalar(select(func.count()).select_from(Job).where(*where)) or 0


def test_prune_deletes_old_finished_and_cancelled_in_batches(db: Database) -> None:
    now = db_now(db.engine)
    old = 8 * 86400
    add_jobs(db.engine, [finished(now, "noop", 1, old) for _ in range(2300)]
             + [finished(now, "noop", 1, old, state="cancelled") for _ in range(5)]
             + [finished(now, "noop", 1, 3600) for _ in range(7)]
             + [{"run_at": now - timedelta(days=9)}])  # an old *pending* job is never pruned
    assert queue.prune(db.engine, older_than=7 * 86400, batch_size=1000, max_batches=1) == 1000
    result = run_cli("prune", *APP, "--finished-older-than", "7d", "--batch-size", "500", env=db.env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "pruned 1305 finished or cancelled job(s) older than 7d"
    assert _count(db) == 8
    assert _count(db, Job.state == "pending") == 1
    assert queue.prune(db.engine, older_than=7 * 86400) == 0
    with pytest.raises(ConfigError):
        queue.prune(db.engine, older_than=-1)


def test_a_prune_cleans_up_after_graphs_and_steps_only_where_they_have_rows(db: Database) -> None:
    """A pruned job takes its edges, batch and steps with it. That clean-up was a statement per table per 1,000 ids,
    each id bound on its own, whatever the app used: ten times the cost of the prune's own DELETE. It is skipped for
    a table without rows, and on PostgreSQL it is one statement per table, the ids one array."""
    now = db_now(db.engine)
    add_jobs(db.engine, [finished(now, "noop", 1, 8 * 86400) for _ in range(2500)])
    cleanups: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        words = statement.split()
        if words[:2] == ["DELETE", "FROM"] and words[2].strip("\"`").endswith(("_deps", "_batches", "_steps")):
            cleanups.append(words[2])

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        assert queue.prune(db.engine, older_than=7 * 86400, batch_size=5000) == 2500
        assert cleanups == []  # no graph, batch or durable step in the tables: nothing to ask them
        if db.partitioned:
            return  # (it prunes whole past days: tested in tests/drivers/test_graph.py)
        with Session(db.engine) as session, session.begin():
            up = Job(kind="noop", payload={})
            session.add_all([up, Job(kind="noop", payload={}, depends_on=[up])])
        run_burst(db.engine)
        with db.engine.begin() as conn:
            conn.execute(update(Job.__table__).values(finished_at=queue.driver(conn).ago(8 * 86400)))
        add_jobs(db.engine, [finished(now, "noop", 1, 8 * 86400) for _ in range(2500)])
        assert queue.prune(db.engine, older_than=7 * 86400, batch_size=5000) == 2502
        deps = [name for name in cleanups if name.endswith("_deps")]
        assert len(deps) == (1 if db.backend == "postgresql" else 3)  # 2,502 ids: one array, or rounds of 1,000
        with db.engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(queue.driver(conn).edges)) == 0
    finally:
        event.remove(db.engine, "before_cursor_execute", record)


def test_worker_prunes_when_asked(db: Database) -> None:
    now = db_now(db.engine)
    add_jobs(db.engine, [finished(now, "noop", 1, 2 * 86400) for _ in range(20)]
             + [finished(now, "noop", 1, 60) for _ in range(3)])
    burst(db)  # without prune_after nothing is deleted
    assert _count(db) == 23
    burst(db, prune_after=86400)
    assert _count(db) == 3
    with pytest.raises(ConfigError):
        Worker(db.engine, queue, prune_after=-5)


def test_only_one_process_prunes_at_a_time_on_postgres(pg: Database) -> None:
    queue.create_tables(pg.engine)
    now = db_now(pg.engine)
    add_jobs(pg.engine, [finished(now, "noop", 1, 86400) for _ in range(10)])
    sql = queue.driver(pg.engine)
    with pg.engine.connect() as holder:
        assert sql.prune_lock(holder)  # another "worker" is pruning
        assert queue.prune(pg.engine, older_than=60) == 0
        holder.rollback()  # its transaction ends: the lock is free
    assert queue.prune(pg.engine, older_than=60) == 10


# -- stats CLI and health --------------------------------------------------------------------


def test_stats_cli_table_and_json(db: Database) -> None:
    build_known_table(db.engine)
    result = run_cli("stats", *APP, env=db.env())
    assert result.returncode == 0, result.stderr
    for needle in ("Queue health", "oldest pending age", "10m", "Run time by kind", "8.8s", "Dead letters by kind",
                   "By queue", "mail", "waiting for a retry", "Retrying by kind"):
        assert needle in result.stdout, needle
    data = json.loads(run_cli("stats", *APP, "--json", "--window", "3h", env=db.env()).stdout)
    assert (data["ready"], data["scheduled"], data["running"], data["dead_total"]) == (4, 3, 2, 3)
    assert 600 <= data["oldest_pending_age"] < 630
    assert {r["kind"]: r["count"] for r in data["run_times"]} == {"a": 6, "b": 1}
    assert data["window"] == 10800
    assert data["retrying"] == {"noop": 1, "a": 1} and data["retrying_total"] == 2


def test_stats_watch_refreshes(db: Database) -> None:
    proc = forkserver.Popen([sys.executable, "-m", "sqla_jobs.cli", "stats", *APP, "--json", "--watch", "0.2"],
                            env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    enqueue(db)
    second: dict[str, Any] = first
    deadline = time.monotonic() + 30
    while second["ready"] == first["ready"] and time.monotonic() < deadline:
        second = json.loads(proc.stdout.readline())
    proc.terminate()
    proc.wait(timeout=30)
    assert (first["ready"], second["ready"]) == (0, 1)


def test_health(db: Database) -> None:
    ok = run_cli("health", *APP, "--max-oldest-age", "15m", env=db.env())
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK: ") and len(ok.stdout.strip().splitlines()) == 1
    add_jobs(db.engine, [{"run_at": db_now(db.engine) - timedelta(minutes=20)}])
    bad = run_cli("health", *APP, "--max-oldest-age", "15m", env=db.env())
    assert bad.returncode == 1
    assert bad.stdout.startswith("UNHEALTHY: the oldest pending job has waited 20m")
    assert "(limit 15m)" in bad.stdout and len(bad.stdout.strip().splitlines()) == 1
    assert run_cli("health", *APP, "--max-oldest-age", "1h", env=db.env()).returncode == 0
    assert run_cli("health", *APP, "--max-oldest-age", "later", env=db.env()).returncode == 2


def test_health_when_the_tables_are_missing(tmp_path: Any) -> None:
    sqlite3.connect(tmp_path / "empty.db").execute("CREATE TABLE other (x INTEGER)").connection.close()
    result = run_cli("health", *APP, "--max-oldest-age", "15m", "--url", f"sqlite:///{tmp_path / 'empty.db'}")
    assert result.returncode == 1
    assert result.stdout.startswith("UNHEALTHY: table 'jobs' does not exist")
    assert len(result.stdout.strip().splitlines()) == 1


def test_health_when_the_database_is_unreachable() -> None:
    result = run_cli("health", *APP, "--max-oldest-age", "15m", "--url",
                     "postgresql+psycopg://postgres@127.0.0.1:1/nowhere?connect_timeout=2")
    assert result.returncode == 1
    assert result.stdout.startswith("UNHEALTHY: cannot reach the database")
    assert len(result.stdout.strip().splitlines()) == 1


def test_cli_works_without_rich(db: Database) -> None:
    """rich is optional (the `cli` extra): without it the tables are plain text."""
    build_known_table(db.engine)
    code = ("import sys; sys.modules['rich'] = None; from sqla_jobs.cli import main; "
            "sys.exit(main(['stats', '--app', 'tests.app:queue']))")
    result = forkserver.run([sys.executable, "-c", code], env=db.env(), cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "┃" not in result.stdout and "│" not in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0] == "Queue health"
    assert any(line.split() == ["ready", "4"] for line in lines)
    assert any(line.startswith("a ") and "8.8s" in line for line in lines)



def test_cancel_races_with_real_workers(db: Database) -> None:
    """Cancelling while two worker processes claim: a job reported cancelled never ran."""
    with Session(db.engine) as session, session.begin():
        jobs = [queue.enqueue(session, "record") for _ in range(150)]
        session.flush()
        job_ids = [job.id for job in jobs]
    workers = [_start_worker(db, "--concurrency", "2") for _ in range(2)]
    outcomes: dict[int, str] = {}
    try:
        for job_id in job_ids:
            with Session(db.engine) as session, session.begin():
                try:
                    outcomes[job_id] = queue.cancel(session, job_id)
                except JobStateError:
                    outcomes[job_id] = "too late"
        _wait_for(lambda: _count(db, Job.state.in_(("pending", "running"))) == 0, timeout=120)
    finally:
        for worker in workers:
            _stop(worker)
    with Session(db.engine) as session:
        rows = {r.id: r for r in session.execute(select(Job)).scalars()}
        ran = {job_id for (job_id,) in session.execute(select(Effect.job_id).where(Effect.event == "start"))}
    for job_id, outcome in outcomes.items():
        row = rows[job_id]
        if outcome == "cancelled":
            assert job_id not in ran and (row.state, row.attempts) == ("cancelled", 0), job_id
        elif outcome == "requested":
            # Finished, unless a heartbeat told the handler before it returned: then cancelled.
            assert job_id in ran and row.state in ("finished", "cancelled") and row.cancelled_at is not None, job_id
        else:
            assert job_id in ran and row.state == "finished" and row.cancelled_at is None, job_id
    assert "cancelled" in outcomes.values()  # the race was real: some were still pending


def test_concurrent_prunes_delete_each_row_once(db: Database) -> None:
    """Three prune processes at once: every old row deleted once, nothing else touched, no errors."""
    now = db_now(db.engine)
    add_jobs(db.engine, [finished(now, "noop", 1, 3 * 86400) for _ in range(4000)]
             + [finished(now, "noop", 1, 60) for _ in range(10)] + [{"run_at": now - timedelta(days=5)}])
    procs = [forkserver.Popen([sys.executable, "-m", "sqla_jobs.cli", "prune", *APP, "--finished-older-than", "1d",
                               "--batch-size", "300"], env=db.env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results
    counts = [int(out.split()[1]) for out, _ in results]
    if sum(counts) < 4000:  # on PostgreSQL a process that finds the prune lock taken stops early
        counts.append(queue.prune(db.engine, older_than=86400))
    assert sum(counts) == 4000
    assert _count(db) == 11 and _count(db, Job.state == "pending") == 1
