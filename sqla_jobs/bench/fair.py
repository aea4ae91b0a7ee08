"""``sqla-jobs bench --fair``: a fair queue (``sqla_jobs._fair``) under one tenant's backlog.

::

    sqla-jobs bench --fair --url postgresql+psycopg://user@host/db --fair-backlog 100000 --runs 3

Each run measures three scenes on queue ``tenants`` with the same worker processes (``--processes`` x
``--concurrency``), tenants B…K each enqueueing one job every 100 ms for ``--fair-window`` seconds:

* **idle**: B…K alone: their pickup latency (the claim's ``locked_at`` less the row's ``created_at``, both
  the database clock), the reference;
* **fair**: tenant A first holds ``--fair-backlog`` pending jobs and the queue is fair: B…K's latency, and
  A's drain rate over the window (its finished jobs per second);
* **unfair**: the same backlog, the queue not fair (today's oldest-first claim): A's drain rate, and how
  many of B…K's jobs were picked up at all within the window.

Then the claim's own cost: ``--batch-size`` jobs claimed (in-process, one transaction each) from a fair
queue holding 10,000 distinct keys, beside the plain claim of an equal backlog without fairness.
Reported: medians over ``--runs``; the goals are B…K's fair p99 within 2x their idle p99 and A's fair
rate at least 80 % of its unfair rate.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from .._app import JobQueue
from ..worker.config import WorkerConfig
from .app import BenchDeadJob, BenchJob, queue
from .processes import bench_worker, run_when_ready, spawned
from .run import Figures, _pct, _reset, reachable, scratch

__all__ = ["run_fair"]

QUEUE = "tenants"
SMALL = [chr(c) for c in range(ord("B"), ord("K") + 1)]  # ten tenants
#: The same tables and handler as the bench's app, with queue ``tenants`` fair.
fair_queue: JobQueue[BenchJob, BenchDeadJob] = JobQueue(BenchJob, BenchDeadJob, check_kinds=False, fair=[QUEUE])
fair_queue.handler("noop")(lambda payload: None)


def _worker_main(url: str, concurrency: int, ready: Any, batch_size: int | None, fair: bool) -> None:
    # Workers of queue `tenants` only, fair or not, as a deployment that gives a fair queue its own workers.
    config = WorkerConfig(concurrency=concurrency, batch_size=batch_size, queues=(QUEUE,))
    run_when_ready(bench_worker(url, fair_queue if fair else queue, config), ready)


@contextmanager
def _workers(url: URL, args: argparse.Namespace, fair: bool) -> Iterator[None]:
    rendered = url.render_as_string(hide_password=False)
    with spawned(args.processes, _worker_main, lambda ready: (rendered, args.concurrency, ready, args.batch_size,
                                                               fair)):
        yield


def _backlog(engine: Engine, n: int, keys: int = 1, queue_name: str = QUEUE) -> None:
    """``n`` pending jobs, their keys ``A`` (one key) or ``k0``… (``keys`` of them, round the keys)."""
    with Session(engine) as session, session.begin():  # the ORM, as an app enqueues (a flush per 5,000)
        for start in range(0, n, 5000):
            session.add_all([BenchJob(kind="noop", queue=queue_name, payload={},
                                      fair_key="A" if keys == 1 else f"k{i % keys:05d}")
                             for i in range(start, min(n, start + 5000))])
            session.flush()
    driver = queue.driver(engine)
    with driver.write(engine) as conn:
        driver.bench_analyze(conn)  # as autovacuum would soon: the claim planned on a table its statistics know


def _count(engine: Engine, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(BenchJob).where(*where)).scalar_one())


class Scene(NamedTuple):
    rate: float  # A's jobs finished a second during the window
    waits: list[float]  # B…K's pickup latencies (ms) from their enqueue transaction's start, picked up by the end
    from_commit: list[float]  # the same from each one's commit
    sent: int  # B…K's jobs enqueued
    a_left: int  # A's jobs still pending as the window closed: 0, and the window's end was not behind a backlog


def _scene(engine: Engine, window: float) -> Scene:
    """Tenants B…K enqueue one job each every 100 ms for ``window`` s, beside A's backlog if it has one."""
    t = BenchJob.__table__
    a_done = (t.c.fair_key == "A", t.c.state == "finished")
    stop = threading.Event()
    driver = queue.driver(engine)
    # created_at from the clock locked_at is read from (the column's default has whole seconds on SQLite).
    clock = driver.now()
    # Seconds from each job's transaction start (created_at) to its commit, by the same clock read right after
    # the commit: on a loaded machine the enqueuer's own commit (its WAL flush among the workers') is part of
    # the first figure, and no worker can see the job before it.
    committing: dict[int, float] = {}

    def produce() -> None:
        i = 0
        while not stop.is_set():
            with Session(engine, expire_on_commit=False) as session:
                with session.begin():
                    job = BenchJob(kind="noop", queue=QUEUE, payload={}, fair_key=SMALL[i % len(SMALL)],
                                   created_at=clock)
                    session.add(job)
                committing[job.id] = float(session.execute(
                    select(driver.seconds_between(clock, t.c.created_at)).where(t.c.id == job.id)).scalar_one())
            i += 1
            stop.wait(max(0.0, began + i * 0.1 / len(SMALL) - time.perf_counter()))

    if _count(engine, t.c.fair_key == "A"):
        # The window opens once the workers drain A: a worker slow to start (a loaded machine) is not
        # charged to the window.
        deadline = time.monotonic() + 60
        while not _count(engine, *a_done) and time.monotonic() < deadline:
            time.sleep(0.05)
    before = _count(engine, *a_done)
    began = time.perf_counter()
    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(window)
    stop.set()
    producer.join()
    rate = (_count(engine, *a_done) - before) / (time.perf_counter() - began)
    a_left = _count(engine, t.c.fair_key == "A", t.c.state == "pending")
    small = t.c.fair_key.in_(SMALL)
    time.sleep(1.0)  # the last ones' pickup
    with engine.connect() as conn:
        picked = [(job_id, float(w) * 1000) for job_id, w in conn.execute(
            select(t.c.id, driver.seconds_between(t.c.locked_at, t.c.created_at))
            .where(small, t.c.locked_at.is_not(None)))]
    from_commit = [w - committing[job_id] * 1000 for job_id, w in picked if job_id in committing]
    return Scene(rate, [w for _, w in picked], from_commit, len(committing), a_left)


def _claim_cost(engine: Engine, limit: int, fair: bool, claims: int = 50) -> float:
    """Milliseconds per claim of ``limit`` jobs, in-process, one write transaction each."""
    driver = queue.driver(engine)
    cursor, took = "", 0.0
    for n in range(claims + 5):  # the first 5 unmeasured: the driver prepares a statement on its 5th run
        began = time.perf_counter()
        with driver.write(engine) as conn:
            if fair:
                _, _, cursor = driver.claim_fair(conn, QUEUE, {}, cursor, limit, "bench", uuid.uuid4().hex, 60.0,
                                                 False)
            else:
                driver.claim(conn, limit, "bench", uuid.uuid4().hex, 60.0, None)
        took += time.perf_counter() - began if n >= 5 else 0.0
    return took / claims * 1000


def run_fair(args: argparse.Namespace) -> int:
    url = reachable(args.url)
    figures = Figures()
    record = figures.record
    window = args.fair_window
    limit = args.batch_size or args.concurrency
    with scratch(url) as bench_url:
        engine = create_engine(bench_url, pool_size=4)
        ran_out = 0  # scenes whose window outlasted A's backlog
        # Every run's pickups together: a p99 of the pooled jobs beside the median of each run's p99 (500 jobs
        # a run at the default window: its p99 is its fifth-slowest job).
        pooled: dict[str, list[float]] = {"idle": [], "fair": []}
        for run in range(args.runs):
            _reset(engine)
            with _workers(bench_url, args, fair=True):
                idle = _scene(engine, window)
            pooled["idle"] += idle.waits
            record("B..K pickup p50, idle queue (ms)", _pct(idle.waits, 50))
            record("B..K pickup p99, idle queue (ms)", _pct(idle.waits, 99))
            record("B..K pickup p99 from the commit, idle queue (ms)", _pct(idle.from_commit, 99))
            for fair in (True, False) if run % 2 == 0 else (False, True):  # neither scene always second
                _reset(engine)
                _backlog(engine, args.fair_backlog)
                with _workers(bench_url, args, fair=fair):
                    scene = _scene(engine, window)
                name = "fair" if fair else "unfair"
                ran_out += scene.a_left == 0
                record(f"A drain, {name} (jobs/s)", scene.rate)
                record(f"A's jobs left at the window's end, {name}", scene.a_left)
                record(f"B..K picked up within the window, {name} (%)", 100.0 * len(scene.waits) / max(scene.sent, 1))
                if fair:
                    pooled["fair"] += scene.waits
                    record("B..K pickup p50, fair, A's backlog (ms)", _pct(scene.waits, 50))
                    record("B..K pickup p99, fair, A's backlog (ms)", _pct(scene.waits, 99))
                    record("B..K pickup p99 from the commit, fair, A's backlog (ms)", _pct(scene.from_commit, 99))
            for fair in (True, False):
                _reset(engine)
                _backlog(engine, 30_000, keys=10_000 if fair else 1, queue_name=QUEUE if fair else "default")
                name = "fair, 10,000 keys" if fair else "plain"
                record(f"claim of {limit}, {name} (ms)", _claim_cost(engine, limit, fair))
            print(f"run {run + 1}/{args.runs} done", flush=True)
        engine.dispose()
    summary = figures.medians()
    summary["B..K p99: fair with backlog / idle"] = (summary["B..K pickup p99, fair, A's backlog (ms)"]
                                                    / max(summary["B..K pickup p99, idle queue (ms)"], 1e-9))
    summary["B..K p99 from the commit: fair with backlog / idle"] = (
        summary["B..K pickup p99 from the commit, fair, A's backlog (ms)"]
        / max(summary["B..K pickup p99 from the commit, idle queue (ms)"], 1e-9))
    summary["B..K pickup p99 of all runs' jobs, idle queue (ms)"] = _pct(pooled["idle"], 99)
    summary["B..K pickup p99 of all runs' jobs, fair, A's backlog (ms)"] = _pct(pooled["fair"], 99)
    summary["B..K p99 of all runs' jobs: fair with backlog / idle"] = (
        summary["B..K pickup p99 of all runs' jobs, fair, A's backlog (ms)"]
        / max(summary["B..K pickup p99 of all runs' jobs, idle queue (ms)"], 1e-9))
    unfair = summary["A drain, unfair (jobs/s)"]
    # No A job finished in a window: its backlog was gone before the window began (too small for the workers).
    summary["A drain: fair / unfair"] = summary["A drain, fair (jobs/s)"] / unfair if unfair > 0 else float("nan")
    summary["scenes whose window outlasted A's backlog"] = ran_out
    if args.json:
        figures.print_json(args, summary)
    else:
        print(f"\nsqla-jobs bench --fair on {url.get_backend_name()}: A holds {args.fair_backlog} jobs, B..K one "
              f"each every 100 ms for {window:g}s; {args.processes} process(es) x {args.concurrency} threads, "
              f"batch {limit}, median of {args.runs} run(s)")
        for name, value in summary.items():
            print(f"  {name:<58} {value:>12,.2f}")
        if not unfair > 0 or not summary["A drain, fair (jobs/s)"] > 0:
            print("  (A's backlog ran out before a window began: give a larger --fair-backlog)")
        elif ran_out:
            # Then the window's end was not behind A's backlog: B..K waited as on an idle queue, A finished nothing.
            print(f"  (A's backlog ran out before the window ended in {ran_out} of {2 * args.runs} scenes: the "
                  "figures are not all behind a backlog; give a larger --fair-backlog or a shorter --fair-window)")
        if math.isnan(summary["B..K pickup p99, fair, A's backlog (ms)"]):
            print("  (no job of B..K was picked up within a fair window: give a longer --fair-window)")
    return 0
