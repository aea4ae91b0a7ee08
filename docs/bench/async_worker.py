"""The threaded worker and the async one side by side, runs interleaved: drain, pickup, idle RSS.

A manual benchmark, not a test. It runs the measurements of ``sqla-jobs bench`` (its ``drain`` and
``pickup_latency``) in a scratch schema or file, alternating the two workers within each run, so a
machine whose load drifts (shared cores) weighs on both alike; ``sqla-jobs bench`` and
``sqla-jobs bench --async`` one after the other cannot promise that::

    python docs/bench/async_worker.py --url postgresql+psycopg://user@host/db [--jobs 10000] [--runs 3]

The async worker drains ``async def`` no-op jobs, the threaded one plain no-op jobs; both with
``--processes`` processes of ``--concurrency`` (threads or tasks) each. Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from sqlalchemy import create_engine

from sqla_jobs._bootstrap import database_url
from sqla_jobs.bench import run as bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-samples", type=int, default=200)
    args = parser.parse_args()
    figures: dict[tuple[str, str], list[float]] = {}
    with bench.scratch(database_url(args.url)) as url:
        engine = create_engine(url, pool_size=10)
        for run in range(args.runs):
            for flavour in ("threaded", "async"):
                asynchronous = flavour == "async"
                bench._reset(engine)
                rate, idle, _, peak = bench.drain(url, engine, args.jobs, args.concurrency, args.processes, 100,
                                                  asynchronous)
                bench._reset(engine)
                latencies = bench.pickup_latency(engine, args.latency_samples, asynchronous)
                row: dict[str, Any] = {"drain (jobs/s)": rate, "pickup p50 (ms)": bench._pct(latencies, 50),
                                       "pickup p95 (ms)": bench._pct(latencies, 95), "idle RSS (MB)": idle,
                                       "peak RSS (MB)": peak}
                for name, value in row.items():
                    figures.setdefault((name, flavour), []).append(value)
                print(f"run {run + 1} {flavour:>8}: " + ", ".join(f"{k} {v:,.2f}" for k, v in row.items()), flush=True)
        engine.dispose()
    print(f"\nmedians of {args.runs}: {'figure':<18} {'threaded':>12} {'async':>12} {'async/threaded':>15}")
    for name in ("drain (jobs/s)", "pickup p50 (ms)", "pickup p95 (ms)", "idle RSS (MB)", "peak RSS (MB)"):
        threaded = statistics.median(figures[(name, "threaded")])
        asynchronous = statistics.median(figures[(name, "async")])
        print(f"{name:<33} {threaded:>12,.2f} {asynchronous:>12,.2f} {asynchronous / threaded:>15.2f}")


if __name__ == "__main__":
    main()
