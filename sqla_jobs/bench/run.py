"""``sqla-jobs bench``: measure sqla-jobs on your own database.

::

    sqla-jobs bench --url postgresql+psycopg://user@host/db --jobs 10000 --concurrency 64 --processes 2

It creates its own tables (PostgreSQL: a scratch schema ``sqla_jobs_bench_<pid>``,
dropped at the end; SQLite: a scratch file beside the one in ``--url``) and
measures, each ``--runs`` times, reporting the median:

* enqueue, one job per transaction (``session.add`` + commit), next to the same
  insert as raw SQL on the same connection, for the overhead ratio, and through the
  DBAPI driver alone (the ceiling of any layer on that driver);
* enqueue, ``session.add_all`` of ``--jobs`` jobs in one transaction, and the same
  for a plain mapped class on the same table (no validators, events or constructor of
  sqla-jobs: what SQLAlchemy's unit of work costs alone, the floor);
* enqueue inside a request: what one job adds to a transaction that already writes a
  business row, through the Session and as a raw ``INSERT`` on the Session's connection
  (microseconds per transaction; the three kinds of transaction take turns in blocks);
* enqueue, ``queue.enqueue_many`` (COPY on PostgreSQL) of ``--jobs`` jobs
  (each way is timed in ``sqla_jobs.bench.enqueue``; the app is ``sqla_jobs.bench.app``);
* drain: ``--processes`` worker processes of ``--concurrency`` threads each,
  idle and listening, then ``--jobs`` no-op jobs committed at once; the rate is
  jobs divided by the time from that commit until the last one is finished;
* pickup latency with an idle worker: from the commit of one job to its handler
  starting, over ``--latency-samples`` jobs (p50 / p95 / p99);
* the worker processes' memory: RSS when idle, after the drain, and peak.

``--async`` measures the AsyncWorker instead (``sqla-jobs worker --async``): the
drain's jobs and the pickup's are ``async def`` no-ops, and ``--concurrency`` is
how many run at once on each process's event loop.

``--finished-rows N`` first fills the table with N finished jobs, to see how
the drain rate holds up before pruning. ``--json`` prints machine-readable results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sqlalchemy import Engine, create_engine, exists, func, select
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from .._bootstrap import database_url, make_async_engine, make_engine, missing_database
from ..drivers import driver_class
from ..worker.async_worker import AsyncWorker
from ..worker.config import WorkerConfig
from ..worker.worker import Worker
from .app import BenchDeadJob, BenchJob, BenchOrder, PlainJob, picked_event, picked_up, queue
from .enqueue import (
    driver_single,
    enqueue_add_all,
    enqueue_beside_business_row,
    enqueue_fast,
    enqueue_single,
)
from .processes import bench_polling, bench_worker, built, run_when_ready, spawned

# The bench app, for scripts and `--app sqla_jobs.bench.run:queue`.
__all__ = ["BenchDeadJob", "BenchJob", "queue", "run_bench"]


# -- scratch database --------------------------------------------------------------


def scratch(url: URL) -> contextlib.AbstractContextManager[URL]:
    """A URL whose tables are the bench's own, removed afterwards (a scratch schema or file: the driver's)."""
    return driver_class(url.get_backend_name()).bench_scratch(url)


def _reset(engine: Engine) -> None:
    BenchJob.metadata.drop_all(engine)
    queue.create_tables(engine)
    BenchOrder.__table__.create(engine)


def _count_finished(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(BenchJob).where(BenchJob.state == "finished")
        ).scalar_one()


def _count_rows(engine: Engine) -> int:
    """Every job in the table, whatever its state (a drain that discards finished jobs leaves none)."""
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(BenchJob)).scalar_one()


def _count_unfinished(engine: Engine) -> int:
    """Pending plus running jobs: each count is served by its partial index, whatever else the table holds."""
    with engine.connect() as conn:
        return sum(
            conn.execute(select(func.count()).select_from(BenchJob).where(BenchJob.state == state)).scalar_one()
            for state in ("pending", "running")
        )


def _any_unfinished(engine: Engine) -> bool:
    """Whether a job is still pending or running: the drain's completion check, polled every 20 ms.

    Each test stops at the first row of its partial index, so the check costs the same at 300,000 jobs
    left as at one; counting them (``_count_unfinished``) read every pending row each poll, up to 20 ms
    of the server's time in every 20 ms at 100,000, taken from the workers being measured.
    """
    with engine.connect() as conn:
        return any(
            conn.execute(select(exists().where(BenchJob.state == state))).scalar_one()
            for state in ("pending", "running")
        )


def _fill_finished(engine: Engine, rows: int) -> None:
    """Old finished jobs, as a queue that has not been pruned would have."""
    with engine.begin() as conn:
        queue.driver(conn).bench_fill_finished(conn, rows)


# -- measurements --------------------------------------------------------------------


def _worker_main(url: str, concurrency: int, ready: Any, batch_size: int | None, asynchronous: bool = False,
                 vacuum_dead_rows: int | None = None, discard_finished: bool = False) -> None:
    # checked, and sizes the pool
    config = WorkerConfig(concurrency=concurrency, batch_size=batch_size, vacuum_dead_rows=vacuum_dead_rows,
                          prune_after=0.0 if discard_finished else None)
    if not asynchronous:
        run_when_ready(bench_worker(url, queue, config), ready)
        return

    engine = create_engine(url)
    config = bench_polling(queue, engine, config)
    engine.dispose()

    async def main() -> None:  # AsyncWorker on the backend's async driver, as `sqla-jobs worker --async` runs it
        async_engine = await make_async_engine(url, pool_size=config.pool_size)
        built(ready)
        await AsyncWorker._from_config(async_engine, queue, config).run(install_signals=True)

    asyncio.run(main())


def _rss_mb(pid: int | None, field: str = "VmRSS") -> float:
    """Resident memory (or with ``VmHWM``, its peak) of a process in MB; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@contextlib.contextmanager
def worker_processes(
    url: URL, concurrency: int, processes: int, batch_size: int | None, asynchronous: bool = False,
    vacuum_dead_rows: int | None = None, discard_finished: bool = False,
) -> Iterator[list[Any]]:
    """``processes`` worker processes of ``concurrency`` threads, started and idle (listening where the
    database notifies, else polling every 20 ms) when this yields; stopped with SIGTERM afterwards."""
    rendered = url.render_as_string(hide_password=False)
    with spawned(processes, _worker_main, lambda ready: (rendered, concurrency, ready, batch_size, asynchronous,
                                                          vacuum_dead_rows, discard_finished)) as procs:
        yield procs


def drain(
    url: URL, engine: Engine, n: int, concurrency: int, processes: int, batch_size: int | None,
    asynchronous: bool = False, vacuum_dead_rows: int | None = None, discard_finished: bool = False,
) -> tuple[float, float, float, float]:
    """Jobs/s, and the workers' largest RSS (MB): idle before, after, and peak during the drain.

    ``discard_finished``: the workers keep no finished jobs (``prune_after=0``), each deleted as it finishes.
    """
    with worker_processes(url, concurrency, processes, batch_size, asynchronous, vacuum_dead_rows,
                          discard_finished) as procs:
        idle_rss = max(_rss_mb(p.pid) for p in procs)
        with Session(engine) as session, session.begin():
            kind = "async_noop" if asynchronous else "noop"
            queue.enqueue_many(session, ({"kind": kind, "payload": {}} for _ in range(n)))
        start = time.perf_counter()
        while _any_unfinished(engine):
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
        time.sleep(0.2)
        after_rss = max(_rss_mb(p.pid) for p in procs)
        peak_rss = max(_rss_mb(p.pid, "VmHWM") for p in procs)
    return n / elapsed, idle_rss, after_rss, peak_rss


def pickup_latency(engine: Engine, samples: int, asynchronous: bool = False) -> list[float]:
    """Milliseconds from the commit of a job to its handler starting, with an idle in-process worker
    (with ``asynchronous``, an AsyncWorker on its own event loop in a thread)."""
    # SQLite has no NOTIFY: the figure there is the polling interval's doing.
    poll = 1.0 if queue.driver(engine).supports_listen else 0.05
    stop: Callable[[], None]
    if asynchronous:
        started = threading.Event()
        holder: list[AsyncWorker] = []

        async def main() -> None:
            async_engine = await make_async_engine(engine.url.render_as_string(hide_password=False))
            holder.append(AsyncWorker(async_engine, queue, concurrency=1, poll_interval=poll))
            started.set()
            await holder[0].run()
            await async_engine.dispose()

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        thread.start()
        started.wait(30)
        stop = holder[0].stop
    else:
        worker = Worker(engine, queue, concurrency=1, poll_interval=poll)
        thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
        thread.start()
        stop = worker.stop
    time.sleep(1.0)
    latencies = []
    for i in range(samples):
        picked_event.clear()
        with Session(engine) as session, session.begin():
            session.add(BenchJob(kind="async_ping" if asynchronous else "ping", payload={"n": i}))
        committed = time.perf_counter()
        if not picked_event.wait(10):
            raise RuntimeError("a job was not picked up within 10 s")
        latencies.append((picked_up[i] - committed) * 1000)
        time.sleep(0.01)
    stop()
    thread.join(30)
    return latencies


def _pct(values: list[float], p: int) -> float:
    """The ``p``-th percentile; with one value that value, with none NaN (a caller says why there were none)."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def reachable(raw_url: str | None) -> URL:
    """The bench's database URL; a server is checked to answer first (a file: the scratch goes beside it)."""
    url = database_url(raw_url)
    if missing_database(url) is None:
        make_engine(raw_url).dispose()
    return url


class Figures:
    """Each figure's value in every run (``record``), their medians, and the ``--json`` report of a bench."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}

    def record(self, name: str, value: float) -> None:
        self.runs.setdefault(name, []).append(value)

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.runs.items()}

    def print_json(self, args: argparse.Namespace, medians: dict[str, float]) -> None:
        print(json.dumps({"settings": vars_of(args), "medians": medians, "runs": self.runs}, indent=2))


def run_bench(args: argparse.Namespace) -> int:
    url = reachable(args.url)
    figures = Figures()
    record = figures.record

    with scratch(url) as bench_url:
        engine = create_engine(bench_url, pool_size=10)
        for run in range(args.runs):
            _reset(engine)
            singles = min(args.jobs, 2000)
            single, raw = enqueue_single(engine, singles)
            record("enqueue one per transaction (jobs/s)", single)
            record("raw SQL insert one per transaction (jobs/s)", raw)
            record("driver alone, one per transaction (jobs/s)", driver_single(engine, singles))
            _reset(engine)
            record("enqueue add_all (jobs/s)", enqueue_add_all(engine, args.jobs))
            _reset(engine)
            record("add_all, plain mapped class: the floor (jobs/s)", enqueue_add_all(engine, args.jobs, PlainJob))
            _reset(engine)
            added = enqueue_beside_business_row(engine, min(args.jobs, 1500))
            record("job added to a business transaction (us)", added["job"])
            record("plain mapped row added to a business transaction (us)", added["plain"])
            record("raw INSERT added to a business transaction (us)", added["raw"])
            _reset(engine)
            record("enqueue_many (jobs/s)", enqueue_fast(engine, args.jobs))
            _reset(engine)
            if args.finished_rows:
                _fill_finished(engine, args.finished_rows)
            finished_before = _count_finished(engine)
            discard = getattr(args, "discard_finished", False)
            rate, idle_rss, after_rss, peak_rss = drain(
                bench_url, engine, args.jobs, args.concurrency, args.processes, args.batch_size,
                getattr(args, "use_async", False), getattr(args, "vacuum_dead_rows", None), discard,
            )
            # Every job ran to its end: finished, or (discarding) finished and deleted, nothing else left.
            if discard:
                assert _count_rows(engine) == finished_before, "the drain left or lost jobs"
            else:
                assert _count_finished(engine) - finished_before == args.jobs
            record("drain (jobs/s)", rate)
            record("worker RSS idle (MB)", idle_rss)
            record("worker RSS after drain (MB)", after_rss)
            record("worker peak RSS (MB)", peak_rss)
            if not args.finished_rows:
                _reset(engine)
                lat = pickup_latency(engine, args.latency_samples, getattr(args, "use_async", False))
                record("pickup p50 (ms)", _pct(lat, 50))
                record("pickup p95 (ms)", _pct(lat, 95))
                record("pickup p99 (ms)", _pct(lat, 99))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr, flush=True)
        engine.dispose()
    summary = figures.medians()
    summary["one-per-transaction vs raw SQL"] = (
        summary["enqueue one per transaction (jobs/s)"] / summary["raw SQL insert one per transaction (jobs/s)"]
    )
    summary["add_all vs the floor"] = (
        summary["enqueue add_all (jobs/s)"] / summary["add_all, plain mapped class: the floor (jobs/s)"]
    )
    # A ratio of two differences of noisy times: only the medians' ratio is shown.
    summary["job vs raw INSERT in a business transaction"] = (
        summary["job added to a business transaction (us)"]
        / max(summary["raw INSERT added to a business transaction (us)"], 1e-9)
    )
    if args.json:
        figures.print_json(args, summary)
    else:
        flavour = "async worker, async no-op handlers" if getattr(args, "use_async", False) else "threaded worker"
        vacuum = f", vacuum at {args.vacuum_dead_rows} dead rows" if getattr(args, "vacuum_dead_rows", None) else ""
        vacuum += ", finished jobs deleted" if getattr(args, "discard_finished", False) else ""
        each = "handlers at once" if getattr(args, "use_async", False) else "threads"
        print(f"\nsqla-jobs bench on {url.get_backend_name()} ({flavour}): {args.jobs} jobs, {args.processes} "
              f"process(es) x {args.concurrency} {each}, batch {args.batch_size or args.concurrency}{vacuum}, "
              f"median of {args.runs} run(s)")
        for name, value in summary.items():
            print(f"  {name:<53} {value:>12,.2f}")
    return 0


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("func", "url")}
