"""What a global limit costs a drain: the same no-op jobs with and without ``limit=N``, runs interleaved.

A manual benchmark, not a test (issue 13, point 10: with a limit at least the number of worker threads,
the drain should keep at least half its unlimited rate)::

    python docs/bench/limits_drain.py --url postgresql+psycopg://user@host/db [--jobs 20000] [--runs 3]

Each run drains ``--jobs`` jobs with an app that declares no limits at all (the worker's one-statement
claim), then as many of a kind without a limit in an app that has one, then as many of a kind with
``limit=--limit`` (default: processes x concurrency, a limit that never binds, so what is measured is
the cost of keeping it), on ``--processes`` worker processes (``sqla-jobs worker``) of
``--concurrency`` threads. The rate is taken from the database's own timestamps, from the first claim
to the last finish, so worker start-up is not counted. Prints each run and the medians.
This file is also the workers' ``--app`` (``limits_drain:queue``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Session

from sqla_jobs import DeadJobMixin, JobMixin, JobQueue


class Base(DeclarativeBase):
    pass


class Job(JobMixin, Base):
    __tablename__ = "bench_limit_jobs"


class DeadJob(DeadJobMixin, Base):
    __tablename__ = "bench_limit_dead"


queue: JobQueue[Job, DeadJob] = JobQueue(Job, DeadJob)
queue.handler("free")(lambda payload: None)
_LIMIT = os.environ.get("LIMITS_DRAIN_LIMIT", "32")
queue.handler("capped", limit=None if _LIMIT == "none" else int(_LIMIT))(lambda payload: None)


def drain(url: str, kind: str, jobs: int, processes: int, concurrency: int, limit: int | None) -> float:
    """Jobs per second of one drain of ``jobs`` jobs of ``kind`` on fresh tables."""
    engine = create_engine(url)
    Base.metadata.drop_all(engine)
    queue.create_tables(engine)
    with Session(engine) as session, session.begin():
        queue.enqueue_many(session, [{"kind": kind} for _ in range(jobs)])
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
           "LIMITS_DRAIN_LIMIT": "none" if limit is None else str(limit)}
    command = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--url", url, "--app", "limits_drain:queue",
               "--concurrency", str(concurrency), "--poll-interval", "0.05"]
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for _ in range(processes)]
    t = Job.__table__
    try:
        while True:
            with engine.connect() as conn:
                if conn.execute(select(func.count()).where(t.c.state == "finished")).scalar() == jobs:
                    break
            if any(w.poll() is not None for w in workers):
                raise SystemExit("a worker exited early: run it by hand to see why")
            time.sleep(0.1)
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(60)
    with engine.connect() as conn:
        first, last = conn.execute(select(func.min(t.c.locked_at), func.max(t.c.finished_at))).one()
    Base.metadata.drop_all(engine)
    engine.dispose()
    return jobs / (last - first).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="default: processes x concurrency")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    limit = args.limit or args.processes * args.concurrency
    rates: dict[str, list[float]] = {"none": [], "free": [], "capped": []}
    for run in range(args.runs):
        # "none": no kind of the app has a limit, so the worker claims in its one-statement way; "free": a kind
        # without a limit in an app that has one (the claim then runs in the limits' write transaction).
        rates["none"].append(drain(args.url, "free", args.jobs, args.processes, args.concurrency, None))
        for kind in ("free", "capped"):
            rates[kind].append(drain(args.url, kind, args.jobs, args.processes, args.concurrency, limit))
        print(f"run {run + 1}: no limits declared {rates['none'][-1]:,.0f} jobs/s, without a limit "
              f"{rates['free'][-1]:,.0f} jobs/s, limit={limit} {rates['capped'][-1]:,.0f} jobs/s", flush=True)
    none, free, capped = (statistics.median(rates[k]) for k in ("none", "free", "capped"))
    print(f"median of {args.runs}: no limits declared {none:,.0f} jobs/s, without a limit {free:,.0f} jobs/s, "
          f"limit={limit} {capped:,.0f} jobs/s ({capped / none:.0%} of the rate with no limits declared, "
          f"{capped / free:.0%} of the unlimited kind's)")


if __name__ == "__main__":
    main()
