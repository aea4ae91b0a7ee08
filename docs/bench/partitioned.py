"""Plain vs partitioned jobs table on PostgreSQL, with millions of finished rows present.

::

    python docs/bench/partitioned.py --url postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        [--finished 5000000] [--jobs 20000] [--runs 3] [--samples 500] [--concurrency 16]

Run it from a checkout, with the Python environment that has sqla-jobs installed
(``pip install -e .``). For each mode (``plain``: ``create-tables``; ``partitioned``: ``create-tables
--partitioned``) in a scratch schema of its own:

1. ``--finished`` finished jobs are written by one ``INSERT … SELECT generate_series`` on
   the server, finished 1 to 6 days ago (the partitioned table gets those days'
   partitions first), then ``VACUUM ANALYZE``, as a queue in steady state has them;
2. claim latency: ``--samples`` calls of the worker's hot statement
   (``finish_and_claim``: finish the previous job, claim one) on one autocommit
   connection, p50 and p95;
3. drain: ``--jobs`` pending no-op jobs (one ``INSERT … SELECT``) drained by an
   in-process burst worker of ``--concurrency`` threads; jobs/s, median of ``--runs``;
4. prune of every row finished before today (UTC): ``JobQueue.prune`` (plain:
   ``DELETE`` in batches of 10,000; partitioned: ``DROP TABLE`` of the past days),
   its time, then the table's size (heap, heap + indexes, summed over the partition
   tree) before and after and after ``VACUUM``, and pgstattuple's dead and free
   space of the plain table (or of the live partition) when the extension is available;
5. claim latency again, after the prune (and before the VACUUM).

The schemas are dropped at the end. Prints a table and, with ``--json PATH``, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine, create_engine, text

from sqla_jobs import Worker
from sqla_jobs.bench.run import queue
from sqla_jobs.drivers.postgresql import partitions as pg_partitions

JOBS = queue.job_model.__table__


def _engine(url: str, schema: str) -> Engine:
    return create_engine(url, connect_args={"options": f"-csearch_path={schema},public"}, pool_size=20, max_overflow=20)


def _fill(engine: Engine, rows: int, partitioned: bool) -> float:
    started = time.perf_counter()
    with engine.begin() as conn:
        if partitioned:  # the days the rows finished on (the leader keeps only today and later)
            today = conn.execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()
            pg_partitions.ensure_days(conn, JOBS, days_ahead=7, today=today - timedelta(days=7))
        conn.execute(text(
            "INSERT INTO jobs (kind, queue, payload, state, attempts, locked_at, finished_at, created_at, run_at) "
            "SELECT 'noop', 'default', '{}'::jsonb, 'finished', 1, t - interval '5 ms', t, t - interval '1 s', "
            "t - interval '1 s' FROM (SELECT now() - make_interval(days => 1 + g % 5, secs => g % 80000) AS t "
            "FROM generate_series(1, :n) AS g) AS s"
        ), {"n": rows})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE jobs"))
    return time.perf_counter() - started


def _pending(engine: Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (kind, payload) SELECT 'noop', '{}'::jsonb FROM generate_series(1, :n)"),
                     {"n": n})


def claim_latency(engine: Engine, samples: int) -> tuple[float, float]:
    """p50 and p95 in ms of the worker's hot statement, finishing the last job and claiming the next."""
    _pending(engine, samples)
    driver = queue.driver(engine)
    times = []
    with engine.connect() as raw:
        conn = raw.execution_options(isolation_level="AUTOCOMMIT")
        fences: list[Any] = []
        for _ in range(samples):
            started = time.perf_counter()
            _, claimed, _ = driver.finish_and_claim(conn, fences, 1, "bench", uuid.uuid4().hex, 60.0, None)
            conn.commit()
            times.append((time.perf_counter() - started) * 1000)
            fences = [c.fence for c in claimed]
        driver.finish_and_claim(conn, fences, 0, "bench", uuid.uuid4().hex, 60.0, None)
        conn.commit()
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.95)]


def drain(engine: Engine, jobs: int, concurrency: int) -> float:
    _pending(engine, jobs)
    started = time.perf_counter()
    Worker(engine, queue, concurrency=concurrency, poll_interval=0.05, listen=False, leader=False).run(burst=True)
    return jobs / (time.perf_counter() - started)


def sizes(engine: Engine, partitioned: bool) -> dict[str, float]:
    with engine.connect() as conn:
        heap, total = conn.execute(text(
            "SELECT sum(pg_relation_size(r)), sum(pg_total_relation_size(r)) "
            "FROM (SELECT relid AS r FROM pg_partition_tree('jobs') UNION SELECT 'jobs'::regclass) AS tree"
        )).one()
        found: dict[str, float] = {"heap_mb": int(heap) / 2**20, "total_mb": int(total) / 2**20}
        target = "jobs_live" if partitioned else "jobs"
        if conn.execute(text("SELECT 1 FROM pg_extension WHERE extname = 'pgstattuple'")).first():
            row = conn.execute(text(f"SELECT dead_tuple_percent, free_percent FROM pgstattuple('{target}')")).one()
            found.update(dead_pct=float(row[0]), free_pct=float(row[1]))
        return found


def measure(url: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    schema = f"bench_part_{mode}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
    engine = _engine(url, schema)
    partitioned = mode == "partitioned"
    result: dict[str, Any] = {"mode": mode}
    try:
        queue.create_tables(engine, partitioned=partitioned)
        result["fill_s"] = _fill(engine, args.finished, partitioned)
        print(f"{mode}: {args.finished} finished rows written in {result['fill_s']:.0f}s", file=sys.stderr)
        result["claim_ms"] = claim_latency(engine, args.samples)
        rates = [drain(engine, args.jobs, args.concurrency) for _ in range(args.runs)]
        result["drain_runs"], result["drain"] = rates, statistics.median(rates)
        print(f"{mode}: claim {result['claim_ms']}, drain {rates}", file=sys.stderr)
        result["before"] = sizes(engine, partitioned)
        midnight = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        older_than = max(60.0, (datetime.now(timezone.utc) - midnight).total_seconds() - 60)
        started = time.perf_counter()
        result["pruned"] = queue.prune(engine, older_than=older_than, batch_size=10_000)
        result["prune_s"] = time.perf_counter() - started
        result["after_prune"] = sizes(engine, partitioned)
        result["claim_ms_after_prune"] = claim_latency(engine, args.samples)
        with engine.connect() as conn:
            started = time.perf_counter()
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM jobs"))
            result["vacuum_s"] = time.perf_counter() - started
        result["after_vacuum"] = sizes(engine, partitioned)
        print(f"{mode}: {json.dumps(result)}", file=sys.stderr)
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return result


def _row(label: str, plain: Any, part: Any) -> str:
    return f"| {label} | {plain} | {part} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--finished", type=int, default=5_000_000)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", default="plain,partitioned")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    url = args.url.replace("postgresql://", "postgresql+psycopg://", 1)
    results = {mode: measure(url, mode, args) for mode in args.modes.split(",")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if len(results) == 2:
        p, q = results["plain"], results["partitioned"]

        def size(r: dict[str, Any], stage: str) -> str:
            s = r[stage]
            extra = f", dead {s['dead_pct']:.0f}% free {s['free_pct']:.0f}%" if "dead_pct" in s else ""
            return f"{s['heap_mb']:.0f} / {s['total_mb']:.0f} MB{extra}"

        print(f"| with {args.finished:,} finished rows | plain | partitioned |\n|---|---|---|")
        print(_row("drain, jobs/s (median of runs)", f"{p['drain']:,.0f}", f"{q['drain']:,.0f}"))
        print(_row("claim p50 / p95, ms", "{:.2f} / {:.2f}".format(*p["claim_ms"]),
                   "{:.2f} / {:.2f}".format(*q["claim_ms"])))
        print(_row("prune of the old rows, s", f"{p['prune_s']:.1f}", f"{q['prune_s']:.2f}"))
        for stage in ("before", "after_prune", "after_vacuum"):
            print(_row(f"size {stage.replace('_', ' ')} (heap / with indexes)", size(p, stage), size(q, stage)))
        print(_row("claim p50 / p95 after prune, ms", "{:.2f} / {:.2f}".format(*p["claim_ms_after_prune"]),
                   "{:.2f} / {:.2f}".format(*q["claim_ms_after_prune"])))
        print(_row("VACUUM after prune, s", f"{p['vacuum_s']:.1f}", f"{q['vacuum_s']:.2f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
