"""Measure what tracing (``sqla_jobs.otel``) costs the worker's drain: the same jobs drained with the app not
instrumented, and instrumented with every job carrying a stored context (so each run reads it and runs in a span).

A manual benchmark, not a test. For each backend given, in a scratch schema (PostgreSQL), database (MariaDB) or
file (SQLite) it drops afterwards: enqueue ``--jobs`` no-op jobs (inside a span, so each stores its context), drain
them with an in-process ``Worker`` of ``--concurrency`` threads in burst mode, and time the drain; the two modes take
turns, ``--runs`` times each, and the medians are printed with their ratio::

    python docs/bench/tracing_drain.py [--jobs 10000] [--runs 3] [--concurrency 16] [--backends postgresql,sqlite]

``on`` exports every span to an SDK ``BatchSpanProcessor`` whose exporter drops them (the SDK's work, not a
collector's network, is what the worker pays for in process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from sqlalchemy import Engine, create_engine, delete
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from docs.bench.async_enqueue import items, scratch
from sqla_jobs import Worker
from sqla_jobs.otel import instrument, uninstrument
from tests.app import Base, Job, queue


class Dropped(SpanExporter):
    """Takes every span and keeps none."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def drain_once(engine: Engine, jobs: int, concurrency: int, traced: bool) -> float:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    instrument(queue, tracer_provider=provider)  # the jobs store the request's context either way
    with Session(engine) as session, session.begin():
        session.execute(delete(Job))
    with provider.get_tracer("bench").start_as_current_span("request"), Session(engine) as session, session.begin():
        queue.enqueue_many(session, items(jobs))
    if not traced:
        uninstrument(queue)
    start = time.perf_counter()
    Worker(engine, queue, concurrency=concurrency, poll_interval=0.05, leader=False).run(burst=True,
                                                                                          install_signals=False)
    took = time.perf_counter() - start
    if traced:
        uninstrument(queue)
    provider.shutdown()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--backends", default="postgresql,sqlite")
    args = parser.parse_args()
    print(f"drain of {args.jobs} no-op jobs, {args.concurrency} threads, median of {args.runs} (jobs/s)")
    for backend in args.backends.split(","):
        with scratch(backend) as url:
            engine = create_engine(url, pool_size=args.concurrency + 4)
            queue.create_tables(engine)
            Base.metadata.create_all(engine)
            took: dict[bool, list[float]] = {False: [], True: []}
            for run in range(args.runs):
                for traced in ((False, True) if run % 2 == 0 else (True, False)):
                    took[traced].append(drain_once(engine, args.jobs, args.concurrency, traced))
            off, on = (args.jobs / statistics.median(took[mode]) for mode in (False, True))
            print(f"{backend:>10}: off {off:>9,.0f}   on {on:>9,.0f}   on/off {on / off:.2f}")
            engine.dispose()


if __name__ == "__main__":
    main()
