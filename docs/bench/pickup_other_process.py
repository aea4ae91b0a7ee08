"""Pickup latency with the enqueuing program in another process: what an app beside its worker sees.

A manual benchmark, not a test. ``sqla-jobs bench`` measures pickup with the enqueuer in the
worker's own process, so the two share one GIL: right after its commit the enqueuing thread runs
Python (closing its session) while the worker wants to claim, and the figure mixes that wait in.
Here one idle worker (``--async``: an ``AsyncWorker`` on its own event loop) runs in this process
and a child process enqueues one job at a time; both stamp ``time.perf_counter()`` (the system's
monotonic clock, the same in both processes), from the enqueuing commit returning to the handler
starting::

    python docs/bench/pickup_other_process.py --url postgresql+psycopg://user@host/db [--async] [--runs 3]

Prints each run's p50 / p95 and the median p50 of the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from sqlalchemy import create_engine

from sqla_jobs._bootstrap import database_url, make_async_engine
from sqla_jobs.bench import run as bench
from sqla_jobs.worker.async_worker import AsyncWorker
from sqla_jobs.worker.worker import Worker

ENQUEUER = r"""
import sys, time
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sqla_jobs.bench import run as bench
engine = create_engine(sys.argv[1])
kind, samples = sys.argv[2], int(sys.argv[3])
for i in range(samples):
    with Session(engine) as session, session.begin():
        session.add(bench.BenchJob(kind=kind, payload={"n": i}))
    print(i, time.perf_counter(), flush=True)
    time.sleep(0.012)
"""


def start_worker(url: str, asynchronous: bool) -> tuple[Callable[[], None], threading.Thread]:
    if not asynchronous:
        worker = Worker(create_engine(url), bench.queue, concurrency=1, poll_interval=1.0)
        thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
        thread.start()
        return worker.stop, thread
    holder: list[AsyncWorker] = []
    started = threading.Event()

    async def main() -> None:
        engine = await make_async_engine(url)
        holder.append(AsyncWorker(engine, bench.queue, concurrency=1, poll_interval=1.0))
        started.set()
        await holder[0].run()
        await engine.dispose()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    started.wait(30)
    return holder[0].stop, thread


def one_run(url: str, asynchronous: bool, samples: int) -> list[float]:
    bench._reset(create_engine(url))
    bench._picked_up.clear()
    stop, thread = start_worker(url, asynchronous)
    time.sleep(1.0)  # past its first look at the table: from now on it sleeps until a NOTIFY
    kind = "async_ping" if asynchronous else "ping"
    out = subprocess.run([sys.executable, "-c", ENQUEUER, url, kind, str(samples)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    time.sleep(0.5)
    stop()
    thread.join(30)
    latencies = []
    for line in out.splitlines():
        i, committed = line.split()
        if int(i) in bench._picked_up:
            latencies.append((bench._picked_up[int(i)] - float(committed)) * 1000)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    p50s = []
    with bench.scratch(database_url(args.url)) as url:
        plain = url.render_as_string(hide_password=False)
        for run in range(args.runs):
            latencies = one_run(plain, args.asynchronous, args.samples)
            p50s.append(statistics.median(latencies))
            p95 = statistics.quantiles(latencies, n=100, method="inclusive")[94]
            print(f"run {run + 1}: {len(latencies)} jobs, pickup p50 {p50s[-1]:.2f} ms, p95 {p95:.2f} ms")
    print(f"{'async' if args.asynchronous else 'threaded'} worker: pickup p50 {statistics.median(p50s):.2f} ms "
          f"(median of {args.runs} runs)")


if __name__ == "__main__":
    main()
