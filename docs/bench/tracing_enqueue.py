"""Measure what tracing (``sqla_jobs.otel``) costs an enqueue: ``session.add_all`` and ``enqueue_many``.

A manual benchmark, not a test. For each backend given, in a scratch schema (PostgreSQL), database
(MariaDB) or file (SQLite) it drops afterwards, enqueues ``--rows`` jobs in one transaction, each way,
``--runs`` times, in each mode, and prints the median jobs per second::

    python docs/bench/tracing_enqueue.py [--rows 5000] [--runs 5] [--backends sqlite,postgresql,mariadb]
                                         [--modes off,idle,on]

Modes: ``off`` the app is not instrumented (what every app without the extra runs); ``idle``
instrumented, but no span is current (a worker's own enqueues, a script); ``on`` instrumented and
inside a span, so every job stores its trace context. ``--modes off`` runs without OpenTelemetry
installed, e.g. against an older checkout of sqla-jobs for the before/after figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, delete
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from docs.bench.async_enqueue import items, scratch
from tests.app import Base, Job, queue


def orm_once(engine: Engine, rows: int, span: Callable[[], Any]) -> float:
    jobs = items(rows)
    start = time.perf_counter()
    with span(), Session(engine) as session, session.begin():
        session.add_all([Job(kind=j["kind"], payload=j["payload"]) for j in jobs])
    return time.perf_counter() - start


def many_once(engine: Engine, rows: int, span: Callable[[], Any]) -> float:
    jobs = items(rows)
    start = time.perf_counter()
    with span(), Session(engine) as session, session.begin():
        queue.enqueue_many(session, jobs)
    return time.perf_counter() - start


def clear(engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.execute(delete(Job))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="sqlite,postgresql,mariadb")
    parser.add_argument("--modes", default="off,idle,on")
    args = parser.parse_args()
    print(f"{args.rows} jobs in one transaction, median of {args.runs} (jobs/s)")
    for backend in args.backends.split(","):
        with scratch(backend) as url:
            engine = create_engine(url)
            queue.create_tables(engine)
            Base.metadata.create_all(engine)
            for mode in args.modes.split(","):
                span: Callable[[], Any] = nullcontext
                if getattr(queue, "tracing", None) is not None:  # off: as an app that never called instrument
                    from sqla_jobs.otel import uninstrument

                    uninstrument(queue)
                if mode != "off":
                    from opentelemetry.sdk.trace import TracerProvider

                    from sqla_jobs.otel import instrument

                    provider = TracerProvider()
                    instrument(queue, tracer_provider=provider)
                    if mode == "on":
                        span = partial(provider.get_tracer("bench").start_as_current_span, "request")
                figures = []
                for way in (orm_once, many_once):
                    took = []
                    for _ in range(args.runs):
                        clear(engine)
                        took.append(way(engine, args.rows, span))
                    figures.append(args.rows / statistics.median(took))
                print(f"{backend:>10} {mode:>4}: session.add_all {figures[0]:>9,.0f}   "
                      f"enqueue_many {figures[1]:>9,.0f}")
            engine.dispose()


if __name__ == "__main__":
    main()
