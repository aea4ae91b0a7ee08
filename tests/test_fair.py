"""Fair queues end to end: worker processes on every backend run each job once, and a small tenant's jobs are
not stuck behind a big one's backlog. The claim's own order is tested in tests/drivers/test_fair.py."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import FairQueue, JobQueue
from sqla_jobs.errors import ConfigError, InvalidJob
from tests import app, fair_app, forkserver
from tests.conftest import ROOT, Database, run_cli
from tests.dashboard_helpers import client
from tests.helpers import enqueue, run_burst
from tests.test_limits import _stop


def _workers(db: Database, n: int, logs: Path, *flags: str) -> list[forkserver.Popen]:
    """``n`` worker processes of tests.fair_app, up and running (their logs in files: see test_limits)."""
    command = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", "tests.fair_app:queue",
               "--poll-interval", "0.05", "--concurrency", "2", *flags]
    workers = []
    for i in range(n):
        with open(logs / f"worker-{i}.log", "w") as log:
            workers.append(forkserver.Popen(command, env=db.env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                            text=True))
    ends = time.monotonic() + 60
    try:
        for i, worker in enumerate(workers):
            while "started" not in (logs / f"worker-{i}.log").read_text():
                assert worker.poll() is None, (logs / f"worker-{i}.log").read_text()
                assert time.monotonic() < ends, "workers did not start within 60 s"
                time.sleep(0.05)
    except BaseException:
        for worker in workers:
            worker.kill()
            worker.wait()
        raise
    return workers


def test_four_processes_share_a_fair_queue_between_tenants(db: Database, tmp_path: Path) -> None:
    """4 processes x 2 threads. Tenant ``big`` enqueues 240 jobs, then 6 small tenants 3 each, and 6 jobs come
    with no key; oldest-first, every small job would wait for the whole backlog. Fairly, each small job starts
    within the first 60 % of the queue's starts, and every job (plus a plain queue's) runs exactly once."""
    _share_between_tenants(db, tmp_path, 4)


def test_async_workers_share_a_fair_queue_on_postgresql(pg: Database, tmp_path: Path) -> None:
    """The same with two async worker processes: their claim is sent through psycopg's async connection
    (``drivers/postgresql/claim.py``), the fair statement through its raw cursor."""
    _share_between_tenants(pg, tmp_path, 2, "--async")


def _share_between_tenants(db: Database, tmp_path: Path, processes: int, *flags: str) -> None:
    fair_app.metadata.create_all(db.engine)
    workers = _workers(db, processes, tmp_path, *flags)
    try:
        with Session(db.engine) as session, session.begin():
            session.add_all([app.Job(kind="noop", queue="fair", fair_key="big",
                                     payload={"key": "big", "sleep": 0.01}) for _ in range(240)])
            session.flush()  # the backlog is older than every small job
            session.add_all([app.Job(kind="noop", queue="fair", payload={"tenant": f"t{i}", "key": f"t{i}"})
                             for i in range(6) for _ in range(3)])
            session.add_all([app.Job(kind="noop", queue="fair", payload={}) for _ in range(6)])
            session.add_all([app.Job(kind="noop", queue="plain", payload={}) for _ in range(10)])
        t = app.Job.__table__
        ends = time.monotonic() + 120
        while True:
            with db.engine.connect() as conn:
                done = conn.execute(select(func.count()).where(t.c.state == "finished")).scalar()
            if done == 274:
                break
            if time.monotonic() > ends:
                with db.engine.connect() as conn:
                    left = conn.execute(select(t.c.queue, t.c.fair_key, t.c.state, func.count())
                                        .where(t.c.state != "finished").group_by(t.c.queue, t.c.fair_key, t.c.state))
                    pytest.fail(f"only {done} of 274 jobs finished in 120 s; left: {left.all()}")
            time.sleep(0.2)
    finally:
        _stop(workers, tmp_path)
    r = fair_app.runs
    with db.engine.connect() as conn:
        runs = conn.execute(select(r.c.job_id, r.c.queue, r.c.key, r.c.started).order_by(r.c.started)).all()
        keys = dict(conn.execute(select(t.c.id, t.c.fair_key)).all())
    assert sorted(run.job_id for run in runs) == sorted(keys)  # each job ran once
    assert {keys[run.job_id] for run in runs if run.key and run.key.startswith("t")} == {f"t{i}" for i in range(6)}
    fair = [run for run in runs if run.queue == "fair"]
    last_small = max(i for i, run in enumerate(fair) if run.key != "big")
    print(f"\n{db.backend}: the last small tenant's job started {last_small + 1}st of {len(fair)}")
    assert last_small < 0.6 * len(fair), [run.key for run in fair]


def test_fair_settings_and_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match="weight"):
        JobQueue(app.Job, app.DeadJob, check_kinds=False, fair={"q": {"a": 0}})
    with pytest.raises(ConfigError, match="queue names"):
        JobQueue(app.Job, app.DeadJob, check_kinds=False, fair=[""])
    assert JobQueue(app.Job, app.DeadJob, check_kinds=False, fair=["q"]).fair == {"q": FairQueue()}
    with pytest.raises(InvalidJob, match="fair_key"):
        app.Job(kind="noop", fair_key="")
    with pytest.raises(InvalidJob, match="fair_key"):
        app.Job(kind="noop", fair_key="x" * 129)


def test_the_key_is_shown_where_jobs_are_listed(db: Database) -> None:
    """``jobs list`` (a column while a listed job has a key), ``jobs show`` and the dashboard's lists and job page."""
    keyed = enqueue(db.engine, "noop", queue="fair", fair_key="tenant-7")
    listed = run_cli("jobs", "list", "--app", "tests.app:queue", env=db.env())
    assert "fair key" in listed.stdout and "tenant-7" in listed.stdout
    shown = json.loads(run_cli("jobs", "show", str(keyed), "--json", "--app", "tests.app:queue", env=db.env()).stdout)
    assert shown["fair_key"] == "tenant-7"
    web = client(db)
    assert "tenant-7" in web.get("/jobs").text and "tenant-7" in web.get(f"/jobs/{keyed}").text


def test_enqueue_many_carries_the_key(db: Database) -> None:
    """``enqueue_many`` (COPY on PostgreSQL) stores a given ``fair_key``, or fills it from the fair queue's
    ``key_field`` as a flush does; items without either take the keyless turn; ``enqueue_unique`` keeps a key
    too; a bad key fails the call before anything is written."""
    app.queue.create_tables(db.engine)
    with Session(db.engine) as session, session.begin():
        count = fair_app.queue.enqueue_many(session, [
            {"kind": "noop", "queue": "fair", "fair_key": "given"},
            {"kind": "noop", "queue": "fair", "payload": {"tenant": "t-9"}},
            {"kind": "noop", "queue": "fair", "payload": {"tenant": 42}},  # a number's text, as a flush makes it
            {"kind": "noop", "queue": "fair"},
            {"kind": "noop", "queue": "other", "payload": {"tenant": "t-1"}},  # not a fair queue: no key filled
            {"kind": "noop", "queue": "fair", "fair_key": "held", "unique_key": "u-1"},
        ])
        fair_app.queue.enqueue_unique(session, "noop", {}, unique_key="u-2", queue="fair", fair_key="unique")
    assert count == 6
    with Session(db.engine) as session:
        keys = session.scalars(select(app.Job.fair_key).order_by(app.Job.id)).all()
    assert keys == ["given", "t-9", "42", None, None, "held", "unique"]
    with pytest.raises(InvalidJob, match="fair_key"), Session(db.engine) as session, session.begin():
        fair_app.queue.enqueue_many(session, [{"kind": "noop", "queue": "fair"},
                                              {"kind": "noop", "queue": "fair", "fair_key": ""}])
    with Session(db.engine) as session:
        assert session.scalar(select(func.count()).select_from(app.Job)) == 7


def test_a_worker_of_fair_queues_alone_claims_their_kinds_with_limits(db: Database) -> None:
    """Kinds with a running limit are claimed under it, not by the fair claim. A worker serving only fair queues
    (``--queue fair``) never claimed them: they waited for ever. Now every job runs, the limit held."""
    limited: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False,
                                                       fair={"fair": FairQueue()})
    spans: list[tuple[float, float]] = []

    @limited.handler("timed", limit=1)
    def timed(payload: dict[str, Any]) -> None:
        started = time.monotonic()
        time.sleep(0.02)
        spans.append((started, time.monotonic()))

    limited.handler("noop")(lambda payload: None)
    limited.create_tables(db.engine)
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind="timed", queue="fair", fair_key=f"t{i % 2}", payload={}) for i in range(4)])
        session.add_all([app.Job(kind="noop", queue="fair", fair_key="t0", payload={}) for _ in range(4)])
    run_burst(db.engine, limited, concurrency=4, queues=["fair"])
    with Session(db.engine) as session:
        states = session.execute(select(app.Job.kind, app.Job.state, func.count())
                                 .group_by(app.Job.kind, app.Job.state)).all()
    assert sorted(states) == [("noop", "finished", 4), ("timed", "finished", 4)]
    spans.sort()
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans)), spans
