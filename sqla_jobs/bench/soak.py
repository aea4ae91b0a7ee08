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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import queue as queue_module
import signal
import statistics
import sys
import threading
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from .._bootstrap import database_url, make_engine, missing_database
from .._durations import parse_duration
from ..errors import ConfigError
from ..worker.config import WorkerConfig
from ..worker.worker import Worker
from .run import BenchDeadJob, BenchJob, _reset, queue, scratch
from .soak_report import SoakReport, Window, write_outputs

__all__ = ["SoakSettings", "run_soak"]

TICK = 0.01  # the producer's step at a set rate: one transaction per tick
MAX_RATE_BATCH = 500  # jobs per transaction with --rate max
CATCH_UP_BATCH = 5_000  # most jobs one tick may carry when the producer fell behind

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
        return cls(
            storage=storage,
            seconds=parse_duration(args.soak), rate=rate, processes=args.processes, concurrency=args.concurrency,
            batch_size=args.batch_size, window=window, prune_after=prune, vacuum_every=vacuum, out=Path(args.out),
            drain_timeout=parse_duration(args.drain_timeout),
        )


# -- worker processes -----------------------------------------------------------------


def _worker_main(url: str, concurrency: int, batch_size: int | None, ready: Any, starts: Any) -> None:
    """One worker process; its handlers' start times go to ``starts`` twice a second and at the end."""
    import logging

    logging.getLogger("sqla_jobs").setLevel(logging.WARNING)
    config = WorkerConfig(concurrency=concurrency, batch_size=batch_size)
    engine = create_engine(url, pool_size=config.pool_size)
    poll = 0.5 if queue.driver(engine).supports_listen else 0.02  # without LISTEN a worker polls
    worker = Worker._from_config(engine, queue, dataclasses.replace(config, poll_interval=poll))
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
    ready.set()
    try:
        worker.run()  # SIGTERM: a graceful stop
    finally:
        done.set()
        shipper.join(10)
        engine.dispose()


# -- the parent's threads -------------------------------------------------------------


class _Tally:
    """What the parent has seen so far, shared by its threads (each field written by one thread)."""

    def __init__(self) -> None:
        self.enqueue_times: array[float] = array("d")  # wall time of each producer transaction
        self.enqueue_counts: array[int] = array("q")
        self.sent = 0
        self.pruned = 0
        self.vacuums = 0
        self.seen = bytearray()
        self.duplicates = 0
        self.unique = 0
        self.latency_by_window: dict[int, array[float]] = {}

    def record_starts(self, chunk: list[tuple[float, int, float]], origin: float, window: float) -> None:
        for started, n, pickup in chunk:
            if n >= len(self.seen):
                self.seen.extend(bytes(max(n + 1 - len(self.seen), 65_536)))
            if self.seen[n]:
                self.duplicates += 1
            else:
                self.unique += 1
            self.seen[n] = 1
            index = int((started - origin) // window)
            self.latency_by_window.setdefault(index, array("d")).append(pickup * 1000)


def _produce(engine: Engine, settings: SoakSettings, tally: _Tally, stop: threading.Event) -> None:
    start = time.perf_counter()
    while not stop.is_set():
        if settings.rate is None:
            count = MAX_RATE_BATCH
        else:
            count = min(int(settings.rate * (time.perf_counter() - start)) - tally.sent, CATCH_UP_BATCH)
            if count <= 0:
                time.sleep(TICK)
                continue
        stamp = time.time()
        first = tally.sent
        rows = ({"kind": "soak", "payload": {"n": first + i, "t": stamp}} for i in range(count))
        with Session(engine) as session, session.begin():
            queue.enqueue_many(session, rows)
        tally.enqueue_times.append(stamp)
        tally.enqueue_counts.append(count)
        tally.sent += count


def _prune(engine: Engine, older_than: float, tally: _Tally, stop: threading.Event) -> None:
    """What ``sqla-jobs prune --finished-older-than AGE`` run every second would do."""
    while not stop.wait(1.0):
        tally.pruned += queue.prune(engine, older_than=older_than, batch_size=5_000)


def _vacuum(engine: Engine, every: float, tally: _Tally, stop: threading.Event) -> None:
    """``VACUUM jobs`` every ``every`` seconds: autovacuum's work where the server's is off or too slow."""
    while not stop.wait(every):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            queue.driver(conn).bench_vacuum(conn)
        tally.vacuums += 1


def _collect(starts: Any, tally: _Tally, origin: float, window: float, stop: threading.Event) -> None:
    while True:
        try:
            chunk = starts.get(timeout=0.2)
        except queue_module.Empty:
            if stop.is_set():
                return
            continue
        tally.record_starts(chunk, origin, window)


def _counts(engine: Engine) -> tuple[int, int]:
    """Pending and running jobs: each count is served by its partial index."""
    with engine.connect() as conn:
        pending, running = (
            conn.execute(select(func.count()).select_from(BenchJob).where(BenchJob.state == state)).scalar_one()
            for state in ("pending", "running")
        )
    return pending, running


def _table_figures(engine: Engine) -> dict[str, float]:
    with engine.connect() as conn:
        return queue.driver(conn).bench_table_stats(conn)


def _progress(index: int, width: float, sample: dict[str, Any], tally: _Tally) -> str:
    """A live line per window; the handler figures of the window before (complete by now) come in the report."""
    figures = sample["figures"]
    parts = []
    if "table_bytes" in figures:
        parts.append(f"table {figures['table_bytes'] / 1e6:.1f} MB + indexes {figures['index_bytes'] / 1e6:.1f} MB")
    if "dead_tuples" in figures:
        parts.append(f"{figures['dead_tuples']:.0f} dead tuples, {figures['autovacuum_count']:.0f} autovacuums")
    size = "".join(", " + part for part in parts)
    return (f"  {(index + 1) * width:6.0f}s {sample['phase']}: enqueued {tally.sent:,}, run {tally.unique:,}, "
            f"pending {sample['pending']:,}{size}")


def _percentile(values: array[float], p: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def _sample(engine: Engine, tally: _Tally, phase: str) -> dict[str, Any]:
    """What the database says at a window's end; the handler figures are joined in once all are shipped."""
    pending, running = _counts(engine)
    return {"phase": phase, "pending": pending, "running": running, "pruned_total": tally.pruned,
            "figures": _table_figures(engine)}


def _windows(samples: list[dict[str, Any]], baseline: dict[str, float], tally: _Tally, origin: float,
             width: float) -> list[Window]:
    enqueued_by_window: dict[int, int] = {}
    for stamp, count in zip(tally.enqueue_times, tally.enqueue_counts, strict=True):
        index = int((stamp - origin) // width)
        enqueued_by_window[index] = enqueued_by_window.get(index, 0) + count
    windows = []
    previous = baseline
    for index, sample in enumerate(samples):
        figures = sample["figures"]
        latencies = tally.latency_by_window.get(index, array("d"))
        counters = ("autovacuum_count", "autoanalyze_count", "vacuum_count")
        runs = {key: figures[key] - previous.get(key, 0.0) for key in counters if key in figures}
        previous = figures
        windows.append(Window(
            start=index * width, phase=sample["phase"],
            enqueued_per_s=enqueued_by_window.get(index, 0) / width, run_per_s=len(latencies) / width,
            pickup_p50_ms=_percentile(latencies, 50), pickup_p95_ms=_percentile(latencies, 95),
            pickup_p99_ms=_percentile(latencies, 99), pickup_max_ms=max(latencies) if latencies else None,
            pending=sample["pending"], running=sample["running"], pruned_total=sample["pruned_total"],
            table_bytes=figures.get("table_bytes"), index_bytes=figures.get("index_bytes"),
            live_tuples=figures.get("live_tuples"), dead_tuples=figures.get("dead_tuples"),
            hot_update_share=figures.get("hot_update_share"),
            autovacuum_runs=runs.get("autovacuum_count"), autoanalyze_runs=runs.get("autoanalyze_count"),
            vacuum_runs=runs.get("vacuum_count"),
        ))
    return windows


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
    readies = [ctx.Event() for _ in range(settings.processes)]
    rendered = url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_worker_main, args=(rendered, settings.concurrency, settings.batch_size, r, starts))
             for r in readies]
    for p in procs:
        p.start()
    if not all(r.wait(60) for r in readies):
        for p in procs:
            p.terminate()
        raise RuntimeError("a soak worker process did not start within 60 s (see its traceback above)")
    time.sleep(0.5)  # let them reach their idle wait
    tally = _Tally()
    stop_producing, stop_pruning, stop_collecting = threading.Event(), threading.Event(), threading.Event()
    origin = time.time()
    baseline = _table_figures(engine)
    threads = [
        threading.Thread(target=_produce, args=(engine, settings, tally, stop_producing), daemon=True),
        threading.Thread(target=_collect, args=(starts, tally, origin, settings.window, stop_collecting), daemon=True),
    ]
    if settings.prune_after is not None:
        threads.append(threading.Thread(target=_prune, args=(engine, settings.prune_after, tally, stop_pruning),
                                        daemon=True))
    if settings.vacuum_every is not None:
        threads.append(threading.Thread(target=_vacuum, args=(engine, settings.vacuum_every, tally, stop_pruning),
                                        daemon=True))
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
            sample = _sample(engine, tally, phase)
            samples.append(sample)
            print(_progress(index, settings.window, sample, tally), file=sys.stderr, flush=True)
            index += 1
            if elapsed >= settings.seconds - 1e-6:
                threads[0].join(30)
                if sample["pending"] == 0 and sample["running"] == 0 and tally.sent == tally.unique:
                    drained_at = elapsed
                    break
                if elapsed > settings.seconds + settings.drain_timeout:
                    print(f"the workers did not drain the backlog within --drain-timeout "
                          f"{settings.drain_timeout:g}s", file=sys.stderr)
                    break
    finally:
        stop_producing.set()
        for p in procs:
            p.terminate()  # SIGTERM: graceful; nothing is running once drained
        for p in procs:
            p.join(60)
        stop_pruning.set()
        time.sleep(0.6)  # the collector reads what the workers shipped on the way out
        stop_collecting.set()
        for t in threads:
            t.join(30)
    pending, running = _counts(engine)
    with engine.connect() as conn:
        dead = conn.execute(select(func.count()).select_from(BenchDeadJob)).scalar_one()
    engine.dispose()
    unique = tally.unique
    return SoakReport(
        windows=_windows(samples, baseline, tally, origin, settings.window),
        totals={
            "enqueued": tally.sent, "run": unique, "missing": tally.sent - unique, "duplicates": tally.duplicates,
            "pending_left": pending, "running_left": running, "dead": dead, "pruned": tally.pruned,
            "vacuums": tally.vacuums,
            "server_autovacuum": {None: None, 1.0: "on", 0.0: "off"}[baseline.get("autovacuum_on")],
            "soak_seconds": settings.seconds, "drained_after_seconds": drained_at,
            "enqueue_rate": tally.sent / settings.seconds if settings.seconds else 0.0,
        },
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_soak(args: argparse.Namespace) -> int:
    settings = SoakSettings.from_args(args)
    url = database_url(args.url)
    if missing_database(url) is None:  # a server: check it answers. A file: the scratch goes beside it
        make_engine(args.url).dispose()
    # A stop (Ctrl-C, SIGTERM) unwinds like an error: the workers are stopped and the scratch removed.
    signal.signal(signal.SIGTERM, _interrupt)
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
        "vacuum_every": settings.vacuum_every,
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
