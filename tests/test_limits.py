"""Limits across workers, end to end: worker processes on every backend never run more than the limit,
and a rate holds the starts to its pace.

The conformance cases (the claim itself, concurrent claimers) are in tests/drivers/test_limits.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import JobQueue, Worker
from sqla_jobs.errors import ConfigError
from tests import app, forkserver, limits_app
from tests.conftest import ROOT, Database


def _workers(db: Database, n: int, concurrency: int, logs: Path,
             plain_only: bool = False) -> list[forkserver.Popen]:
    """``n`` worker processes, up and running. Their logs go to files: a worker logs a line per job, and a pipe
    nobody reads until the end would fill and stop it mid-run (its leases would then expire)."""
    command = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", "tests.limits_app:queue",
               "--poll-interval", "0.05", "--concurrency", str(concurrency)]
    workers = []
    for i in range(n):
        with open(logs / f"worker-{i}.log", "w") as log:
            env = db.env(LIMITS_APP_PLAIN="1" if plain_only else "0")
            workers.append(forkserver.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                                            text=True))
    ends = time.monotonic() + 60
    try:
        for i, worker in enumerate(workers):
            log = logs / f"worker-{i}.log"
            while "started" not in log.read_text():
                assert worker.poll() is None, f"worker exited before it started: {log.read_text()}"
                assert time.monotonic() < ends, "workers did not start within 60 s"
                time.sleep(0.05)
    except BaseException:
        for worker in workers:  # none left running against a database the fixture drops
            worker.kill()
            worker.wait()
        raise
    return workers


def _stop(workers: list[forkserver.Popen], logs: Path) -> None:
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
    try:
        for i, worker in enumerate(workers):
            try:
                worker.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {i} did not stop within 120 s of SIGTERM: "
                            f"{(logs / f'worker-{i}.log').read_text()[-3000:]}")
            assert worker.returncode == 0, (logs / f"worker-{i}.log").read_text()[-3000:]
    finally:
        for worker in workers:  # none left running against a database the fixture drops
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def _enqueue(db: Database, jobs: list[dict[str, Any]]) -> None:
    with Session(db.engine) as session, session.begin():
        limits_app.queue.enqueue_many(session, jobs)


def _wait_done(db: Database, total: int, timeout: float) -> None:
    t = app.Job.__table__
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        with db.engine.connect() as conn:
            done = conn.execute(select(func.count()).where(t.c.state == "finished")).scalar()
        if done == total:
            return
        time.sleep(0.2)
    pytest.fail(f"only {done} of {total} jobs finished in {timeout:g}s")


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start closes first)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_most_at_once_counts_overlaps() -> None:
    assert most_at_once([(0, 2), (1, 3), (2, 4)]) == 2
    assert most_at_once([(0, 5), (1, 2), (1.5, 3), (4, 6)]) == 3
    assert most_at_once([]) == 0


class Sampler(threading.Thread):
    """Polls the jobs table: the most running jobs of a kind, and of one key of per_customer, seen at once."""

    def __init__(self, db: Database) -> None:
        super().__init__(daemon=True)
        self.db, self.stop, self.samples = db, threading.Event(), 0
        self.capped = self.per_key = 0

    def run(self) -> None:
        t = app.Job.__table__
        running = select(t.c.kind, t.c.payload).where(t.c.state == "running", t.c.kind.in_(["capped", "per_customer"]))
        with self.db.engine.connect() as conn:
            while not self.stop.is_set():
                rows = conn.execute(running).all()
                conn.rollback()  # a fresh snapshot next time
                self.samples += 1
                self.capped = max(self.capped, sum(r.kind == "capped" for r in rows))
                keys = [r.payload["customer"] for r in rows if r.kind == "per_customer"]
                self.per_key = max([self.per_key, *(keys.count(k) for k in set(keys))])
                time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("plain_only", [False, True], ids=["mixed", "plain"])
def test_four_processes_never_run_more_than_the_limit(db: Database, tmp_path: Path, plain_only: bool) -> None:
    """4 worker processes x 16 threads, 2,000 jobs of a kind limited to 3 (plus a per-key kind and free jobs).

    ``plain``: the app's only limit is that plain one, so PostgreSQL's workers claim in one pipeline
    (drivers/postgresql/capped.py) instead of claim_limited's transaction.
    """
    limits_app.metadata.create_all(db.engine)
    keyed = 0 if plain_only else 150
    _enqueue(db, [{"kind": "capped", "payload": {"sleep": 0.01}} for _ in range(2000)]
             + [{"kind": "per_customer", "payload": {"customer": f"c{i % 5}", "sleep": 0.01}} for i in range(keyed)]
             + [{"kind": "free"} for _ in range(300)])
    sampler = Sampler(db)
    sampler.start()
    started = time.monotonic()
    workers = _workers(db, 4, 16, tmp_path, plain_only)
    try:
        _wait_done(db, 2300 + keyed, timeout=600)
    finally:
        took = time.monotonic() - started
        sampler.stop.set()
        sampler.join()
        _stop(workers, tmp_path)
    r = limits_app.runs
    with db.engine.connect() as conn:
        rows = conn.execute(select(r.c.kind, r.c.key, r.c.pid, r.c.started, r.c.ended)).all()
        attempts = conn.execute(select(func.max(app.Job.__table__.c.attempts))).scalar()
    capped = [(row.started, row.ended) for row in rows if row.kind == "capped"]
    assert len(capped) == 2000 and attempts == 1  # each ran once: waiting burned no attempt
    exact = most_at_once(capped)
    per_key = max(most_at_once([(row.started, row.ended) for row in rows if row.key == key])
                  for key in {f"c{i}" for i in range(5)})
    pids = sorted({row.pid for row in rows if row.kind == "capped"})
    print(f"\n{db.backend}: 2,000 capped jobs in {took:.1f}s, run by {len(pids)} of the 4 processes; "
          f"most at once: {exact} from the logged runs, {sampler.capped} in {sampler.samples} samples; "
          f"per key {per_key} (runs) / {sampler.per_key} (samples)")
    assert exact <= limits_app.CAPPED and sampler.capped <= limits_app.CAPPED
    assert per_key <= limits_app.PER_CUSTOMER and sampler.per_key <= limits_app.PER_CUSTOMER
    # The limit was reached (so the test could have seen it broken): in the table, and in the runs too
    # unless the three runs of a batch never overlapped in their handlers (one thread started late).
    assert sampler.capped == limits_app.CAPPED and exact >= limits_app.CAPPED - 1


@pytest.mark.slow
@pytest.mark.serial  # a measured rate: alone on the machine, as users run it
def test_a_rate_holds_starts_to_its_pace(db: Database, tmp_path: Path) -> None:
    """20 starts a second (10 per 0.5 s) across 3 processes: the achieved rate, measured, within the bound."""
    limits_app.metadata.create_all(db.engine)
    count, period = limits_app.RATE
    total = 140
    _enqueue(db, [{"kind": "paced"} for _ in range(total)])
    workers = _workers(db, 3, 8, tmp_path)
    try:
        _wait_done(db, total, timeout=300)
    finally:
        _stop(workers, tmp_path)
    r = limits_app.runs
    with db.engine.connect() as conn:
        starts = sorted(conn.execute(select(r.c.started)).scalars())
        attempts = conn.execute(select(func.max(app.Job.__table__.c.attempts))).scalar()
    assert len(starts) == total and attempts == 1
    # After the first bucketful (``count`` at once), the bucket refills at count/period a second.
    steady = starts[count:]
    achieved = (len(steady) - 1) / (steady[-1] - steady[0])
    busiest = max(sum(1 for s in starts if t <= s < t + period) for t in starts)
    print(f"\n{db.backend}: configured {count / period:g}/s, achieved {achieved:.2f}/s after the first {count}; "
          f"busiest {period:g}s window: {busiest} starts")
    # Documented tolerance (docs/howto/limits.md): never above the rate (a start is a claim, and the handler's
    # own start lags it by scheduling jitter only: 10 %), and not far below it while jobs wait (a generous 50 %).
    assert 0.5 * count / period <= achieved <= 1.1 * count / period
    # A bucket lets ``count`` through at once plus the refill: at most 2 x count in any window of one period
    # (+2 for the handler-start jitter at the window's edges).
    assert busiest <= 2 * count + 2


@pytest.mark.parametrize(("options", "message"), [
    ({"limit": 0}, "limit must be a whole number"),
    ({"limit": 2.5}, "limit must be a whole number"),
    ({"limit_key": "customer"}, "needs limit="),
    ({"limit": 1, "limit_key": "a.b"}, "top-level payload field"),
    ({"rate": (0, 1)}, "rate must be"),
    ({"rate": (5, 0)}, "rate must be"),
    ({"rate": 5}, "rate must be"),
])
def test_bad_limits_say_what_to_pass(options: dict[str, Any], message: str) -> None:
    queue = JobQueue(app.Job, app.DeadJob, check_kinds=False)
    with pytest.raises(ConfigError, match=message):
        queue.handler("k", **options)(lambda payload: None)


def test_kind_limits_lists_the_limited_kinds() -> None:
    kinds = {lim.kind: lim for lim in limits_app.queue.kind_limits()}
    assert sorted(kinds) == ["capped", "paced", "per_customer"]
    assert kinds["per_customer"].key == "customer" and kinds["paced"].refill == 20.0
    assert app.queue.kind_limits() == []  # no limits: the worker's claim is the plain one


def test_the_limits_table_is_the_apps_when_declared_and_alembic_sees_it(db: Database) -> None:
    """Undeclared, a worker creates it beside the app's tables; declared in the app's metadata, it is one of
    them: create_all makes it and alembic autogenerate adds it to a revision (the migration path)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect
    from sqlalchemy.orm import DeclarativeBase

    from sqla_jobs import DeadJobMixin, JobMixin, limits_table
    from sqla_jobs.testing import run_due

    class Base(DeclarativeBase):
        pass

    class LimJob(JobMixin, Base):
        __tablename__ = "lim_jobs"

    class LimDead(DeadJobMixin, Base):
        __tablename__ = "lim_dead"

    own = JobQueue(LimJob, LimDead)
    own.handler("capped", limit=1)(lambda payload: None)
    Base.metadata.create_all(db.engine)
    with db.engine.connect() as conn:
        pending = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert not [d for d in pending if d[0] == "add_table"]  # undeclared: not the app's, nothing to migrate
    with Session(db.engine) as session, session.begin():
        own.enqueue_many(session, [{"kind": "capped"} for _ in range(3)])
    assert len(run_due(db.engine, own, concurrency=4).finished) == 3
    assert inspect(db.engine).has_table("lim_jobs_limits", schema=db.schema)  # the worker made it
    assert "lim_jobs_limits" not in Base.metadata.tables
    declared = limits_table(own, Base.metadata)
    assert Base.metadata.tables["lim_jobs_limits"] is declared and limits_table(own) is declared
    with db.engine.begin() as conn:
        declared.drop(conn)
    with db.engine.connect() as conn:
        pending = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert [d[1].name for d in pending if d[0] == "add_table"] == ["lim_jobs_limits"]


# An app of its own for the in-process test below (check_kinds=False: see tests/limits_app.py).
_paced_app: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)
_paced_app.handler("slow_capped", limit=3)(lambda payload: time.sleep(0.05))
_paced_app.handler("unlimited")(lambda payload: None)


def test_the_claim_of_other_kinds_is_not_repeated_while_it_finds_nothing(db: Database) -> None:
    """A backlog of a limited kind: the ordinary claim (which walks past that backlog's pending rows) is made
    again only after a poll interval once it found nothing, not on every turn; a job of another kind enqueued
    meanwhile still starts, within that interval."""
    from sqla_jobs import Worker

    with Session(db.engine) as session, session.begin():
        _paced_app.enqueue_many(session, [{"kind": "slow_capped"} for _ in range(40)])
    worker = Worker(db.engine, _paced_app, concurrency=4, poll_interval=0.5, listen=False)
    driver = worker._store.driver  # the worker's own driver: count the ordinary claims it makes beside limits
    ordinary: list[float] = []
    claim = driver.finish_and_claim

    def counted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("skip_kinds") and args[2] > 0:  # a claim (limit > 0), not a write of finishes alone
            ordinary.append(time.monotonic())
        return claim(*args, **kwargs)

    capped = driver.finish_and_claim_capped

    def counted_capped(*args: Any) -> Any:  # PostgreSQL: the ordinary claim rides in the pipeline when plain
        if args[10]:
            ordinary.append(time.monotonic())
        return capped(*args)

    driver.finish_and_claim = counted  # type: ignore[method-assign]
    driver.finish_and_claim_capped = counted_capped  # type: ignore[method-assign]
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    started = time.monotonic()
    thread.start()
    try:
        time.sleep(0.3)  # the backlog is being worked
        with Session(db.engine) as session, session.begin():
            _paced_app.enqueue_many(session, [{"kind": "unlimited"}])  # tests.app's own kinds check skipped
        _wait_done(db, 41, timeout=120)
        took = time.monotonic() - started
    finally:
        worker.stop()
        thread.join(60)
    t = app.Job.__table__
    with db.engine.connect() as conn:
        assert conn.execute(select(t.c.state).where(t.c.kind == "unlimited")).scalar_one() == "finished"
    # 40 jobs of 50 ms, 3 at a time: at least 0.65 s and some 14 claims of the limited kind. Without the rule
    # each of those claims makes an ordinary claim too; with it, one per poll interval at most (+1 to start).
    assert len(ordinary) <= took / 0.5 + 2, (len(ordinary), took)


def test_the_limits_drain_benchmark_runs(tmp_path: Path) -> None:
    """docs/bench/limits_drain.py and limits_turn.py (the figures in docs/howto/limits.md), small, so they
    cannot rot."""
    run = forkserver.run([sys.executable, str(ROOT / "docs" / "bench" / "limits_drain.py"), "--url",
                          f"sqlite:///{tmp_path / 'bench.db'}", "--jobs", "200", "--runs", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "of the rate with no limits declared" in run.stdout and "limit=32" in run.stdout, run.stdout
    turn = forkserver.run([sys.executable, str(ROOT / "docs" / "bench" / "limits_turn.py"), "--url",
                           f"sqlite:///{tmp_path / 'turn.db'}", "--jobs", "64"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert turn.returncode == 0, turn.stderr
    assert "plain=True: 5 turns" in turn.stdout, turn.stdout


@pytest.mark.parametrize("plain_only", [False, True], ids=["mixed", "plain"])
def test_a_worker_that_keeps_no_finished_jobs_deletes_limited_ones_too(db: Database, plain_only: bool) -> None:
    """``prune_after=0`` with limits: the finishes beside a limited claim delete too, on the portable path
    (``mixed``: keyed and rate limits) and on PostgreSQL's one-pipeline claim of plain limits (``plain``)."""
    limits_app.metadata.create_all(db.engine)
    queue = limits_app.queue
    if plain_only:
        queue = JobQueue(app.Job, app.DeadJob, check_kinds=False)
        queue.handler("capped", limit=2)(lambda payload: None)
        queue.handler("free")(lambda payload: None)
    _enqueue(db, [{"kind": "capped"} for _ in range(30)] + [{"kind": "free"} for _ in range(30)])
    worker = Worker(db.engine, queue, concurrency=4, poll_interval=0.05, prune_after=0)
    assert worker.driver.discard_finished
    assert worker.run(burst=True, install_signals=False) == 0
    with db.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(app.Job.__table__)).scalar() == 0
        assert conn.execute(select(func.count()).select_from(app.DeadJob.__table__)).scalar() == 0
    assert worker.processed == 60
