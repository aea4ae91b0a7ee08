"""What one finish-and-claim round trip costs by batch size: why short jobs want a high ``--concurrency``.

    python docs/bench/batch_cost.py --url postgresql+psycopg://postgres@127.0.0.1/test
        [--jobs 30000] [--batches 8,32,64,128,256] [--runs 3] [--discard-finished]

A worker claims only as many jobs as it has free threads, and waits until half of them are free, so
with ``--concurrency C`` its claims take about C/2 jobs. This script runs the worker's own hot
statement (``Driver.finish_and_claim`` on an autocommit connection, as ``Store`` holds it: finish
the last batch, claim the next, one round trip) from one connection, batch after batch through a
backlog of ``--jobs`` pending jobs, and prints the median time of one round trip and what that is
per job. The fixed part of a round trip (the pipeline, the commit, the statement's start) is paid
once per batch, so small batches cost the server several times more per job than large ones.
``--discard-finished`` times both statements instead: jobs finished by ``UPDATE`` (kept) and by
``DELETE`` (a worker with ``--prune-finished-older-than 0``), the two passes taking turns.
docs/performance.md ("Short jobs: claim in large batches") shows what it printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from sqla_jobs.bench import run as bench


def one_pass(url: str, jobs: int, batch: int, discard: bool = False) -> float:
    """Median seconds of one finish-and-claim round trip with ``batch`` jobs each way, on a fresh table
    (``discard``: the worker's statement that deletes what it finishes)."""
    engine = create_engine(url)
    try:
        bench._reset(engine)
        with Session(engine) as session, session.begin():
            bench.queue.enqueue_many(session, ({"kind": "noop", "payload": {}} for _ in range(jobs)))
        driver = bench.queue.driver(engine)
        if discard:
            driver = driver.discarding_finished()
        token = uuid.uuid4().hex
        spent: list[float] = []
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            fences: list[tuple[int, str]] = []
            while True:
                start = time.perf_counter()
                _, claimed, _ = driver.finish_and_claim(conn, fences, batch, "batch-cost", token, 60.0, None)
                if len(fences) == len(claimed) == batch:  # a full batch each way: the figure this measures
                    spent.append(time.perf_counter() - start)
                fences = [job.fence for job in claimed]
                if not fences:
                    break
        finished, left = bench._count_finished(engine), bench._count_rows(engine)
        if (left, finished) != ((0, 0) if discard else (jobs, jobs)):
            raise SystemExit(f"{finished} of {jobs} jobs finished and {left} left: the statement lost some")
        if len(spent) < 2:
            raise SystemExit(f"--jobs {jobs} holds too few batches of {batch} to time")
        return statistics.median(spent[1:])  # the first plans the statement
    finally:
        engine.dispose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="a PostgreSQL URL (a scratch schema is made and dropped)")
    p.add_argument("--jobs", type=int, default=30_000, help="pending jobs to work through per pass")
    p.add_argument("--batches", default="8,32,64,128,256", help="batch sizes, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="passes per batch size (medians are printed)")
    p.add_argument("--discard-finished", action="store_true",
                   help="also time the statement that deletes the jobs it finishes (--prune-finished-older-than 0)")
    args = p.parse_args()
    sizes = [int(s) for s in args.batches.split(",")]
    ways = (False, True) if args.discard_finished else (False,)
    results: dict[tuple[int, bool], list[float]] = {(size, way): [] for size in sizes for way in ways}
    with bench.scratch(make_url(args.url)) as url:
        rendered = url.render_as_string(hide_password=False)
        for size in sizes:
            for run in range(args.runs):
                for way in ways if run % 2 == 0 else ways[::-1]:  # taking turns: a slow minute falls on both
                    results[size, way].append(one_pass(rendered, args.jobs, size, way))
    print("| batch | finished jobs | round trip, ms | per job, µs |")
    print("|---:|---|---:|---:|")
    for (size, way), runs in results.items():
        median = statistics.median(runs)
        print(f"| {size} | {'deleted' if way else 'kept'} | {median * 1000:.2f} | {median * 1e6 / size:.1f} |")


if __name__ == "__main__":
    main()
