"""procrastinate side of the comparison (runs in the scratch virtualenv that has procrastinate and psycopg).

::

    python docs/bench/peer_procrastinate.py --dsn postgresql://... --schema scratch --drain 1x10,2x10

Applies procrastinate's schema inside ``--schema`` (selected through
``search_path``), and measures, as jobs/s unless noted:

* ``single_enqueue``: ``task.defer_async()`` once per job (each its own transaction);
* ``bulk_enqueue``: one ``task.batch_defer_async(...)`` of ``--jobs`` jobs;
* ``drain``: for each PROCESSESxCONCURRENCY setting, that many idle worker
  processes (``app.run_worker_async(concurrency=C)``, async no-op task), then
  ``--jobs`` jobs deferred in one batch; jobs / (time from that batch
  returning until no job is ``todo`` or ``doing``);
* ``pickup_p50_ms`` / ``pickup_p95_ms``: one idle in-process worker, one job
  deferred at a time, from ``defer_async`` returning (committed) to the task starting.

Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import procrastinate
import psycopg
from _child import base_parser, emit, log, parse_settings, percentile

try:
    from importlib.metadata import version

    VERSION = version("procrastinate")
except Exception:  # pragma: no cover - only for a label
    VERSION = "?"

_handled: Any = None  # a shared counter, in worker processes
_started: dict[int, float] = {}
_arrived = asyncio.Event()


def make_app(dsn: str, schema: str) -> procrastinate.App:
    connector = procrastinate.PsycopgConnector(conninfo=dsn, kwargs={"options": f"-csearch_path={schema}"})
    app = procrastinate.App(connector=connector)

    @app.task(name="noop")
    async def noop(i: int = 0) -> None:
        if _handled is not None:
            with _handled.get_lock():
                _handled.value += 1

    @app.task(name="ping")
    async def ping(n: int) -> None:
        _started[n] = time.perf_counter()
        _arrived.set()

    return app


def sql(dsn: str, schema: str, query: str) -> Any:
    with psycopg.connect(dsn, autocommit=True, options=f"-csearch_path={schema}") as conn:
        cur = conn.execute(query)
        return cur.fetchone() if cur.description else None


def clear(dsn: str, schema: str) -> None:
    sql(dsn, schema, "TRUNCATE procrastinate_jobs CASCADE")


# -- worker processes -----------------------------------------------------------------


def _worker_main(dsn: str, schema: str, concurrency: int, ready: Any, handled: Any) -> None:
    global _handled
    _handled = handled
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_worker(dsn, schema, concurrency, ready))


async def _worker(dsn: str, schema: str, concurrency: int, ready: Any) -> None:
    app = make_app(dsn, schema)
    async with app.open_async():
        ready.set()
        await app.run_worker_async(concurrency=concurrency, wait=True, install_signal_handlers=True)


# -- measurements ------------------------------------------------------------------------


async def single_enqueue(app: procrastinate.App, dsn: str, schema: str, n: int) -> float:
    clear(dsn, schema)
    task = app.tasks["noop"]
    start = time.perf_counter()
    for i in range(n):
        await task.defer_async(i=i)
    return n / (time.perf_counter() - start)


async def bulk_enqueue(app: procrastinate.App, dsn: str, schema: str, n: int) -> float:
    clear(dsn, schema)
    task = app.tasks["noop"]
    start = time.perf_counter()
    await task.batch_defer_async(*({"i": i} for i in range(n)))
    return n / (time.perf_counter() - start)


async def drain(app: procrastinate.App, dsn: str, schema: str, n: int, processes: int, concurrency: int,
                timeout: float) -> float:
    clear(dsn, schema)
    ctx = mp.get_context("spawn")
    handled = ctx.Value("q", 0)
    readies = [ctx.Event() for _ in range(processes)]
    procs = [ctx.Process(target=_worker_main, args=(dsn, schema, concurrency, r, handled)) for r in readies]
    for p in procs:
        p.start()
    pending = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    try:
        with psycopg.connect(dsn, autocommit=True, options=f"-csearch_path={schema}") as watcher:
            for r in readies:
                if not await asyncio.to_thread(r.wait, 60):
                    raise RuntimeError("a procrastinate worker did not start within 60 s")
            await asyncio.sleep(0.5)  # let them reach their idle wait, as `sqla-jobs bench` does
            await app.tasks["noop"].batch_defer_async(*({} for _ in range(n)))
            start = time.perf_counter()
            while (watcher.execute(pending).fetchone() or (0,))[0] > 0:
                if not all(p.is_alive() for p in procs):
                    raise RuntimeError("a procrastinate worker process died during the drain (see above)")
                if time.perf_counter() - start > timeout:
                    raise TimeoutError(f"procrastinate drain of {n} jobs did not finish within {timeout:.0f} s")
                await asyncio.sleep(0.02)
            elapsed = time.perf_counter() - start
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            await asyncio.to_thread(p.join, 30)
            if p.is_alive():
                p.kill()
                p.join()
    if handled.value != n:
        raise RuntimeError(f"procrastinate ran {handled.value} tasks for {n} jobs")
    return n / elapsed


async def pickup_latency(app: procrastinate.App, dsn: str, schema: str, samples: int) -> list[float]:
    clear(dsn, schema)
    worker = asyncio.create_task(app.run_worker_async(concurrency=1, wait=True, install_signal_handlers=False))
    await asyncio.sleep(1.0)
    latencies = []
    try:
        for i in range(samples):
            _arrived.clear()
            await app.tasks["ping"].defer_async(n=i)
            committed = time.perf_counter()
            await asyncio.wait_for(_arrived.wait(), 10)
            latencies.append((_started[i] - committed) * 1000)
            await asyncio.sleep(0.01)
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(worker, 30)
    return latencies


async def amain() -> None:
    p = base_parser("procrastinate side of the sqla-jobs comparison")
    p.add_argument("--drain", default="1x10,2x10",
                   help="PROCESSESxCONCURRENCY worker settings to try (default 1x10,2x10)")
    args = p.parse_args()
    settings = parse_settings(args.drain)
    logging.basicConfig(level=logging.WARNING)
    app = make_app(args.dsn, args.schema)
    result: dict[str, Any] = {"system": f"procrastinate {VERSION}"}
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        log("procrastinate: one defer per transaction")
        result["single_enqueue"] = await single_enqueue(app, args.dsn, args.schema, args.single_jobs)
        log("procrastinate: batch defer")
        result["bulk_enqueue"] = await bulk_enqueue(app, args.dsn, args.schema, args.jobs)
        result["drain"] = {}
        for processes, concurrency in settings:
            log(f"procrastinate: drain, {processes} process(es), concurrency {concurrency}")
            result["drain"][f"{processes}x{concurrency}"] = await drain(
                app, args.dsn, args.schema, args.jobs, processes, concurrency, args.drain_timeout
            )
        log("procrastinate: pickup latency")
        lat = await pickup_latency(app, args.dsn, args.schema, args.latency_samples)
    result["pickup_p50_ms"] = percentile(lat, 50)
    result["pickup_p95_ms"] = percentile(lat, 95)
    emit(result)


if __name__ == "__main__":
    asyncio.run(amain())
