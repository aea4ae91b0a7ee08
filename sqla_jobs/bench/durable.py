"""``sqla-jobs bench --durable``: what durable jobs cost (docs/howto/durable.md).

::

    sqla-jobs bench --url postgresql+psycopg://user@host/db --durable --waiters 10000

In the bench's scratch schema or file (``sqla_jobs.bench.run.scratch``), each ``--runs`` times, reporting
medians:

* per step: ``--latency-samples`` jobs of ten no-op steps (``steps10`` in ``sqla_jobs.bench.app``) run by one
  worker process of one thread; each ``step`` call is timed inside the handler (its fn does
  nothing, so the time is the step's own: the first reads the job's steps, each writes its checkpoint in a
  transaction of its own). p50 / p99 in ms (target p50 <= 2 ms on PostgreSQL).
* emit -> resume: ``--latency-samples`` jobs, each parked waiting for its own event, then the events emitted
  one transaction each, 20 ms apart, while one listening worker process waits. A sample is the resumed
  run's claim (``locked_at``) minus the event's ``emitted_at``, both by the database clock. p50 / p99 in ms
  (target p50 <= 5 ms on PostgreSQL; elsewhere the workers poll every 20 ms, and the figure is mostly that).
* many waiters: ``--waiters`` N jobs parked, each waiting for its own event, by ``--processes`` worker
  processes of ``--concurrency`` threads; while they are parked, the connections the server has open to the
  database and the workers' threads and memory, against the same workers idle before; then all N events
  emitted in one transaction by one ``emit_events`` call, and the seconds from its commit until the last job
  finished (target <= 5 s for 10,000).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from ..drivers import step_table
from ..errors import ConfigError
from .app import BenchJob, queue
from .run import Figures, _any_unfinished, _pct, _reset, _rss_mb, reachable, scratch, worker_processes

__all__ = ["run_durable"]

STEP, EMIT, WOKEN = "step", "emit -> resume", "waiters"


def _threads(pid: int | None) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def _wait(what: str, done: Any, procs: list[Any], limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while not done():
        if any(p.exitcode is not None for p in procs):
            raise RuntimeError(f"{what}: a worker process exited ({[p.exitcode for p in procs]})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done after {limit:.0f} s")
        time.sleep(0.02)


def _parked(engine: Engine) -> int:
    s = step_table(BenchJob.__table__)  # type: ignore[arg-type]
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(s).where(s.c.awaiting.is_not(None),
                                                                          s.c.finished_at.is_(None))).scalar_one())


def _enqueue_waiters(engine: Engine, n: int, prefix: str) -> None:
    with Session(engine) as session, session.begin():
        queue.enqueue_many(session, ({"kind": "await", "payload": {"key": f"{prefix}{i}"}} for i in range(n)))


def step_times(args: argparse.Namespace, url: Any, engine: Engine) -> list[float]:
    n = args.latency_samples
    with worker_processes(url, 1, 1, None) as procs:  # one job at a time: the step's own cost, not contention
        with Session(engine) as session, session.begin():
            queue.enqueue_many(session, ({"kind": "steps10", "payload": {}} for _ in range(n)))
        _wait("the steps", lambda: not _any_unfinished(engine), procs)
    with engine.connect() as conn:
        results = conn.execute(select(BenchJob.result).where(BenchJob.kind == "steps10")).scalars()
        return [ms for result in results for ms in result]


def emit_latencies(args: argparse.Namespace, url: Any, engine: Engine) -> list[float]:
    n = args.latency_samples
    with worker_processes(url, args.concurrency, 1, args.batch_size) as procs:
        _enqueue_waiters(engine, n, "k")
        _wait("parking", lambda: _parked(engine) == n, procs)
        for i in range(n):
            with Session(engine) as session, session.begin():
                queue.emit_event(session, f"k{i}", i)
            time.sleep(0.02)
        _wait("the resumed jobs", lambda: not _any_unfinished(engine), procs)
    with Session(engine) as session:  # each resumed run's claim, beside its event's emit
        rows = session.execute(select(BenchJob.payload, BenchJob.locked_at)).all()
        emitted = {row.payload["key"]: queue.get_event(session, row.payload["key"]).emitted_at for row in rows}
    return [(row.locked_at - emitted[row.payload["key"]]).total_seconds() * 1000 for row in rows]


def many_waiters(args: argparse.Namespace, url: Any, engine: Engine) -> dict[str, float]:
    n = args.waiters
    driver = queue.driver(engine)
    figures: dict[str, float] = {}
    with worker_processes(url, args.concurrency, args.processes, args.batch_size) as procs:
        with engine.connect() as conn:
            idle_connections = driver.open_connections(conn)
        idle_rss = sum(_rss_mb(p.pid) for p in procs)
        idle_threads = sum(_threads(p.pid) for p in procs)
        _enqueue_waiters(engine, n, "w")
        _wait("parking", lambda: _parked(engine) == n, procs)
        time.sleep(1.0)  # the workers settle back to idle
        with engine.connect() as conn:
            parked_connections = driver.open_connections(conn)
        if idle_connections is not None and parked_connections is not None:
            figures["server connections, idle workers"] = idle_connections
            figures[f"server connections, {n:,} jobs parked"] = parked_connections
        figures["worker threads, idle"] = idle_threads
        figures[f"worker threads, {n:,} jobs parked"] = sum(_threads(p.pid) for p in procs)
        figures["worker RSS MB, idle"] = idle_rss
        figures[f"worker RSS MB, {n:,} jobs parked"] = sum(_rss_mb(p.pid) for p in procs)
        start = time.perf_counter()
        with Session(engine) as session, session.begin():
            queue.emit_events(session, {f"w{i}": i for i in range(n)})
            committing = time.perf_counter()
        committed = time.perf_counter()
        figures[f"emit {n:,} events in one transaction (s)"] = committed - start
        figures["of which the commit (s)"] = committed - committing
        _wait("the woken jobs", lambda: not _any_unfinished(engine), procs)
        figures[f"all {n:,} resumed and finished after the commit (s, target <= 5)"] = time.perf_counter() - committed
    return figures


def run_durable(args: argparse.Namespace) -> int:
    if args.soak is not None or args.graphs is not None:
        raise ConfigError("--durable, --graphs and --soak are different benches: give one")
    if args.latency_samples < 2 or args.waiters < 1:
        raise ConfigError("--durable needs --latency-samples >= 2 and --waiters >= 1")
    url = reachable(args.url)
    figures = Figures()
    record = figures.record

    with scratch(url) as bench_url:
        engine = create_engine(bench_url, pool_size=10)
        for run in range(args.runs):
            _reset(engine)
            steps = step_times(args, bench_url, engine)
            for p in (50, 99):
                record(f"{STEP} p{p} (ms, target p50 <= 2)", _pct(steps, p))
            _reset(engine)
            latencies = emit_latencies(args, bench_url, engine)
            for p in (50, 99):
                record(f"{EMIT} p{p} (ms, target p50 <= 5)", _pct(latencies, p))
            _reset(engine)
            for name, value in many_waiters(args, bench_url, engine).items():
                record(name, value)
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
        engine.dispose()
    summary = figures.medians()
    if args.json:
        figures.print_json(args, summary)
        return 0
    print(f"\nsqla-jobs bench --durable on {url.get_backend_name()}: {args.latency_samples} jobs of 10 steps "
          f"(1 process x 1 thread), {args.latency_samples} emits (1 process x {args.concurrency} threads); "
          f"{args.waiters:,} waiters ({args.processes} process(es) x {args.concurrency} threads); "
          f"median of {args.runs} run(s)")
    for name, value in summary.items():
        print(f"  {name:<62} {value:>12,.2f}")
    return 0

