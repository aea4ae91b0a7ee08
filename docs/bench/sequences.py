"""Measure what a ``sequence_key`` costs (docs/howto/sequences.md): the enqueue, and draining chains.

A manual benchmark, not a test. For each backend given, in a scratch schema (PostgreSQL), database
(MariaDB) or file (SQLite) it drops afterwards, it measures, ``--runs`` times each, the median of:

* one job per transaction, ``--single`` transactions: no key, all on one key, each on its own key;
* ``--rows`` jobs in one transaction (``session.add_all``): no key, spread over ``--keys`` keys;
* draining ``--rows`` no-op jobs with one in-process worker of ``--concurrency`` threads: no key, and
  ``--keys`` sequences (each job waits for the one before it in its key: a hop per job)::

    python docs/bench/sequences.py [--single 500] [--rows 2000] [--keys 20] [--concurrency 8] [--runs 3]
                                   [--backends sqlite,postgresql,mariadb]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, create_engine, delete
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from docs.bench.async_enqueue import scratch
from sqla_jobs import Worker
from sqla_jobs.drivers import edge_table
from tests.app import Base, Job, queue


def clear(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.execute(delete(Job))
        session.execute(delete(edge_table(Job.__table__)))


def one_per_transaction(engine: Engine, n: int, key: Callable[[int], str | None]) -> float:
    start = time.perf_counter()
    for i in range(n):
        with Session(engine) as session, session.begin():
            session.add(Job(kind="noop", payload={"n": i}, sequence_key=key(i)))
    return n / (time.perf_counter() - start)


def in_one_transaction(engine: Engine, n: int, key: Callable[[int], str | None]) -> float:
    start = time.perf_counter()
    with Session(engine) as session, session.begin():
        session.add_all([Job(kind="noop", payload={"n": i}, sequence_key=key(i)) for i in range(n)])
    return n / (time.perf_counter() - start)


def drain(engine: Engine, n: int, key: Callable[[int], str | None], concurrency: int) -> float:
    in_one_transaction(engine, n, key)
    start = time.perf_counter()
    Worker(engine, queue, concurrency=concurrency, poll_interval=0.01).run(burst=True, install_signals=False)
    took = time.perf_counter() - start
    with Session(engine) as session:
        left = session.query(Job).filter(Job.state != "finished").count()
    assert left == 0, f"{left} jobs not finished"
    return n / took


def median(runs: int, engine: Engine, measure: Callable[[], float]) -> float:
    figures = []
    for _ in range(runs):
        clear(engine)
        figures.append(measure())
    return statistics.median(figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, default=500)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,postgresql,mariadb")
    args = parser.parse_args()
    print(f"jobs/s, median of {args.runs}")
    for backend in args.backends.split(","):
        with scratch(backend) as url:
            engine = create_engine(url)
            queue.create_tables(engine)
            Base.metadata.create_all(engine)
            none, one = (lambda i: None), (lambda i: "k")
            own, spread = (lambda i: f"k{i}"), (lambda i: f"k{i % args.keys}")
            rows = {
                f"enqueue, {args.single} transactions of 1 job": [
                    median(args.runs, engine, lambda k=k, e=engine: one_per_transaction(e, args.single, k))
                    for k in (none, one, own)],
                f"enqueue, 1 transaction of {args.rows} jobs": [
                    median(args.runs, engine, lambda k=k, e=engine: in_one_transaction(e, args.rows, k))
                    for k in (none, spread)] + [None],
                f"drain {args.rows} jobs, {args.concurrency} threads": [
                    median(args.runs, engine, lambda k=k, e=engine: drain(e, args.rows, k, args.concurrency))
                    for k in (none, spread)] + [None],
            }
            print(f"{backend}: no key | one key (or {args.keys} keys) | a key per job")
            for name, (plain, keyed, single) in rows.items():
                extra = "" if single is None else f" | {single:>8,.0f}"
                print(f"  {name:<42} {plain:>8,.0f} | {keyed:>8,.0f}{extra}")
            engine.dispose()


if __name__ == "__main__":
    main()
