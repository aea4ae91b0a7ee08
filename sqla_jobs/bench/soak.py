"""``sqla-jobs bench --soak SECONDS``: a steady stream of jobs for minutes, measured window by window.

::

    sqla-jobs bench --url postgresql+psycopg://user@host/db --soak 300 --rate 5000 --out soak-results

A burst (``sqla-jobs bench``) says how fast a backlog drains; a queue in
production instead takes a steady stream for hours, and what goes wrong there
goes wrong slowly: dead row versions pile up faster than autovacuum removes
them, the table and its indexes grow, the claim reads more pages, and pickup
tails stretch. The soak makes that visible. In the bench's scratch schema (or
file) it runs ``--processes`` worker processes and, in this process,

* a producer that enqueues ``--rate`` jobs per second (``enqueue_many``, one
  transaction per 10 ms tick) or, with ``--rate max``, as fast as it can;
* a pruner that deletes finished jobs older than ``--soak-prune`` (what
  ``sqla-jobs prune`` run from cron would do), so the table has a bounded size;
* a monitor that every ``--window`` seconds (10) samples the pending count and
  the driver's table figures (on PostgreSQL: table and index bytes, live and
  dead tuples, HOT updates, autovacuum and autoanalyze runs).

Each handler records when it started; pickup is the time from the producer's
enqueue call (commit included) to that start. After ``--soak`` seconds the
producer stops, the workers drain what is left, and the report checks that
every enqueued job ran exactly once. Windows go to ``soak.json`` and
``soak.csv`` under ``--out``, and a plot to ``soak.png`` (matplotlib, from the
``bench`` extra).

Here: the settings, the worker processes and the run. The parent's threads (producer, pruner,
vacuumer, the collector of handler starts) are ``soak_load``; the samples and the windows made of
them ``soak_monitor``; the report and its files ``soak_report``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select

from .._bootstrap import database_url, make_engine, missing_database
from .._durations import parse_duration
from ..errors import ConfigError
from ..worker.config import WorkerConfig
from .processes import bench_worker, run_when_ready, watch_bench
from .run import BenchDeadJob, BenchJob, _reset, queue, scratch
from .soak_faults import FAULT_HEARTBEAT, FAULT_LEASE, Fault, Fleet, inject_faults
from .soak_load import Tally, collect, produce, prune, vacuum
from .soak_monitor import pending_and_running, progress_line, sample_now, table_figures, windows_of
from .soak_report import SoakReport, write_outputs

__all__ = ["SoakSettings", "run_soak"]

# Handler starts in a worker process, (wall-clock start, job number, pickup seconds), until shipped.
_starts: deque[tuple[float, int, float]] = deque()


@queue.handler("soak")
def soak(payload: dict[str, Any]) -> None:
    started = time.time()
    _starts.append((started, payload["n"], started - payload["t"]))


@dataclasses.dataclass(frozen=True)
class SoakSettings:
    seconds: float
    rate: float | None  # None: as fast as the producer can
    processes: int
    concurrency: int
    batch_size: int | None  # None: the worker's default (its concurrency)
    window: float
    prune_after: float | None  # None: keep finished jobs
    vacuum_every: float | None  # None: leave dead rows to autovacuum
    out: Path
    drain_timeout: float
    storage: dict[str, str] = dataclasses.field(default_factory=dict)  # the jobs table's, e.g. fillfactor
    faults: int | None = None  # the seed of the faults (soak_faults), or None for none
    fault_every: tuple[float, float] = (30.0, 60.0)  # seconds between two faults, drawn in this range

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SoakSettings:
        rate_text = str(args.rate).strip().lower()
        if rate_text == "max":
            rate = None
        else:
            try:
                rate = float(rate_text)
            except ValueError:
                raise ConfigError(f"--rate: {args.rate!r} is neither a number of jobs per second nor 'max'") from None
            if not rate > 0:
                raise ConfigError(f"--rate must be > 0 jobs/s (or 'max'), got {args.rate}")
        prune = None if str(args.soak_prune).lower() == "none" else parse_duration(args.soak_prune)
        vacuum = None if str(args.soak_vacuum).lower() == "none" else parse_duration(args.soak_vacuum)
        window = parse_duration(args.window)
        if not window > 0:
            raise ConfigError("--window must be > 0 seconds, e.g. 10s")
        storage = {}
        for item in filter(None, (part.strip() for part in (args.storage or "").split(","))):
            name, equals, value = item.partition("=")
            if not equals or not name.strip() or not value.strip():
                raise ConfigError(f"--storage: {item!r} is not NAME=VALUE, e.g. fillfactor=70")
            storage[name.strip()] = value.strip()
        low, dash, high = str(args.fault_every).partition("-")
        try:
            fault_every = (float(low), float(high if dash else low))
        except ValueError:
            raise ConfigError(f"--fault-every: {args.fault_every!r} is not MIN-MAX seconds, e.g. 30-60") from None
        if not 0 < fault_every[0] <= fault_every[1]:
            raise ConfigError(f"--fault-every: {args.fault_every!r} needs 0 < MIN <= MAX, e.g. 30-60")
        return cls(
            fault_every=fault_every, storage=storage,
            seconds=parse_duration(args.soak), rate=rate, processes=args.processes, concurrency=args.concurrency,
            batch_size=args.batch_size, window=window, prune_after=prune, vacuum_every=vacuum, out=Path(args.out),
            drain_timeout=parse_duration(args.drain_timeout), faults=args.faults,
        )


# -- worker processes -----------------------------------------------------------------


def _worker_main(url: str, concurrency: int, batch_size: int | None, faults: bool, ready: Any, starts: Any) -> None:
    """One worker process; its handlers' start times go to ``starts`` twice a second and at the end."""
    watch_bench()
    config = WorkerConfig(concurrency=concurrency, batch_size=batch_size)
    if faults:
        config = dataclasses.replace(config, lease=FAULT_LEASE, heartbeat=FAULT_HEARTBEAT)
    worker = bench_worker(url, queue, config)
    done = threading.Event()

    def ship() -> None:
        while True:
            stopping = done.wait(0.5)
            chunk = []
            while _starts:
                chunk.append(_starts.popleft())
            if chunk:
                starts.put(chunk)
            if stopping:
                return

    shipper = threading.Thread(target=ship, daemon=True)
    shipper.start()
    try:
        run_when_ready(worker, ready)
    finally:
        done.set()
        shipper.join(10)
        worker.engine.dispose()


# -- the run ------------------------------------------------------------------------------


def soak_run(url: Any, settings: SoakSettings) -> SoakReport:
    """One soak on ``url`` (a scratch database of the bench's), windows and totals."""
    engine = create_engine(url, pool_size=10)
    _reset(engine)
    if settings.storage:
        with engine.begin() as conn:
            queue.driver(conn).bench_storage(conn, settings.storage)
    if settings.vacuum_every is not None:  # once now, so a backend without it says so before anything starts
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            queue.driver(conn).bench_vacuum(conn)
    ctx = mp.get_context("spawn")
    starts = ctx.Queue()
    rendered = url.render_as_string(hide_password=False)

    def start_worker() -> Any:
        ready = ctx.Event()
        proc = ctx.Process(target=_worker_main, args=(rendered, settings.concurrency, settings.batch_size,
                                                      settings.faults is not None, ready, starts))
        proc.start()
        if not ready.wait(60):
            proc.terminate()
            raise RuntimeError("a soak worker process did not start within 60 s (see its traceback above)")
        return proc

    fleet = Fleet(start_worker)
    try:
        fleet.grow(settings.processes)
    except BaseException:
        for p in fleet.procs:
            p.terminate()
        raise
    time.sleep(0.5)  # let them reach their idle wait
    tally = Tally()
    stop_producing, stop_pruning, stop_collecting = threading.Event(), threading.Event(), threading.Event()
    origin = time.time()
    baseline = table_figures(engine)
    faults: list[Fault] = []
    threads = [
        threading.Thread(target=produce, args=(engine, settings.rate, tally, stop_producing), daemon=True),
        threading.Thread(target=collect, args=(starts, tally, origin, settings.window, stop_collecting), daemon=True),
    ]
    if settings.prune_after is not None:
        threads.append(threading.Thread(target=prune, args=(engine, settings.prune_after, tally, stop_pruning),
                                        daemon=True))
    if settings.vacuum_every is not None:
        threads.append(threading.Thread(target=vacuum, args=(engine, settings.vacuum_every, tally, stop_pruning),
                                        daemon=True))
    injector = None if settings.faults is None else threading.Thread(
        target=inject_faults, daemon=True,
        args=(settings.faults, settings.fault_every, fleet, engine, origin, faults, stop_producing))
    if injector is not None:
        threads.append(injector)
    for t in threads:
        t.start()
    samples: list[dict[str, Any]] = []
    index = 0
    drained_at: float | None = None
    try:
        while True:
            time.sleep(max(0.0, origin + (index + 1) * settings.window - time.time()))
            elapsed = time.time() - origin
            phase = "soak" if index * settings.window < settings.seconds - 1e-6 else "drain"
            if elapsed >= settings.seconds - 1e-6:
                stop_producing.set()
            sample = sample_now(engine, tally, phase)
            samples.append(sample)
            print(progress_line(index, settings.window, sample, tally), file=sys.stderr, flush=True)
            index += 1
            if elapsed >= settings.seconds - 1e-6:
                threads[0].join(30)
                if sample["pending"] == 0 and sample["running"] == 0 and tally.sent == _ran(engine, settings, tally):
                    drained_at = elapsed
                    break
                if elapsed > settings.seconds + settings.drain_timeout:
                    print(f"the workers did not drain the backlog within --drain-timeout "
                          f"{settings.drain_timeout:g}s", file=sys.stderr)
                    break
    finally:
        stop_producing.set()
        if injector is not None:
            injector.join(2 * FAULT_LEASE)  # a stalled worker is let go before the fleet stops
        for p in fleet.procs:
            p.terminate()  # SIGTERM: graceful; nothing is running once drained
        for p in fleet.procs:
            p.join(60)
        stop_pruning.set()
        time.sleep(0.6)  # the collector reads what the workers shipped on the way out
        stop_collecting.set()
        for t in threads:
            t.join(30)
    pending, running = pending_and_running(engine)
    with engine.connect() as conn:
        dead = conn.execute(select(func.count()).select_from(BenchDeadJob)).scalar_one()
    unique = _ran(engine, settings, tally)
    engine.dispose()
    # Under faults a start seen twice is a rerun after a crash (at-least-once), not a duplicate: the count
    # of jobs run comes from the finished rows, where a job cannot finish twice.
    seen_twice = {"duplicates": tally.duplicates} if settings.faults is None else {
        "reruns": tally.duplicates, "faults": [dataclasses.asdict(f) for f in faults]}
    return SoakReport(
        windows=windows_of(samples, baseline, tally, origin, settings.window),
        totals={
            "enqueued": tally.sent, "run": unique, "missing": tally.sent - unique, **seen_twice,
            "pending_left": pending, "running_left": running, "dead": dead, "pruned": tally.pruned,
            "vacuums": tally.vacuums,
            "server_autovacuum": {None: None, 1.0: "on", 0.0: "off"}[baseline.get("autovacuum_on")],
            "soak_seconds": settings.seconds, "drained_after_seconds": drained_at,
            "enqueue_rate": tally.sent / settings.seconds if settings.seconds else 0.0,
        },
    )


def _ran(engine: Any, settings: SoakSettings, tally: Tally) -> int:
    """Jobs that ran: the handler starts seen, or under faults the jobs finished (those still in the table and
    those the pruner deleted), since a killed worker takes the starts it had not shipped with it, and its
    jobs' second starts are reruns."""
    if settings.faults is None:
        return tally.unique
    pruned = tally.pruned  # read first: a prune committing meanwhile is then missed once, never counted twice
    with engine.connect() as conn:
        finished = conn.execute(select(func.count()).select_from(BenchJob).where(BenchJob.state == "finished"))
        return int(finished.scalar_one()) + pruned


def run_soak(args: argparse.Namespace) -> int:
    settings = SoakSettings.from_args(args)
    url = database_url(args.url)
    if missing_database(url) is None:  # a server: check it answers. A file: the scratch goes beside it
        make_engine(args.url).dispose()
    rate = "max" if settings.rate is None else f"{settings.rate:g}/s"
    print(f"soak: {settings.seconds:g}s at {rate}, {settings.processes} process(es) x {settings.concurrency} threads, "
          f"windows of {settings.window:g}s, prune after {settings.prune_after}", file=sys.stderr, flush=True)
    with scratch(url) as bench_url:
        report = soak_run(bench_url, settings)
    report.system = "sqla-jobs"
    report.settings = {
        "backend": url.get_backend_name(), "seconds": settings.seconds, "rate": settings.rate,
        "processes": settings.processes, "concurrency": settings.concurrency, "batch_size": settings.batch_size,
        "window": settings.window, "prune_after": settings.prune_after, "storage": settings.storage,
        "vacuum_every": settings.vacuum_every, "faults": settings.faults,
    }
    files = write_outputs({"sqla-jobs": report}, settings.out)
    report.files = files
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.summary_text())
    for kind, path in files.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0 if report.complete else 1
