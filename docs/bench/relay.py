"""Measure relay throughput: jobs/s from a PostgreSQL table to RabbitMQ and to NATS JetStream (manual, not a test).

For each broker and each run: enqueue ``--jobs`` jobs in a scratch schema
(dropped afterwards), then time one relay, in this process, from its start
until the last job is finished (connect, claim, publish, wait for every
broker ack, finish). In the same run, right before or after it (alternating),
``relay_ceiling.py`` publishes the same number of the same messages through the
same client with no database: the client's own ceiling. Prints each run, and
per broker the medians and the ratio relay / ceiling::

    python docs/bench/relay.py [--url postgresql+psycopg://postgres@127.0.0.1:5432/test] \
        [--brokers rabbitmq,nats] [--jobs 20000] [--batch 500] [--runs 3] [--processes N] [--no-ceiling]

Each run declares its own RabbitMQ exchange and durable queue, or its own
JetStream stream (file storage), before the clock starts (as the ceiling
does), and deletes them when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from docs.bench.relay_ceiling import ceiling
from sqla_jobs.relay import Relay
from tests.relay.brokers import NATS_URL, RABBITMQ_URL, BrokerSpace
from tests.relay_app import queue

ROOT = Path(__file__).resolve().parent.parent.parent


def one_run(url: str, broker: str, jobs: int, batch: int, processes: int = 0) -> float:
    """Jobs per second of one relay run over ``jobs`` fresh jobs: in this process, or ``processes``
    ``sqla-jobs relay --until-idle`` processes on the same queue (their start-up included)."""
    schema = f"bench_relay_{uuid.uuid4().hex[:8]}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = create_engine(make_url(url).update_query_dict({"options": f"-csearch_path={schema}"}))
    space = BrokerSpace(broker)
    try:
        queue.create_tables(engine)
        with Session(engine) as session, session.begin():
            queue.enqueue_many(session, [{"kind": "order.created", "queue": "relay", "payload": {"order": n}}
                                         for n in range(jobs)])
        routes = {"order.created": "stored.orders.created"}
        # The stream or exchange and queue are declared before the clock starts, as relay_ceiling.py
        # declares them before its own: a relay finds them there and only looks them up.
        asyncio.run(_declare(space.target(routes)))
        start = time.perf_counter()
        if processes:
            published = _in_processes(engine, space, routes, batch, processes)
        else:
            gc.collect()  # as `sqla-jobs relay` does before it runs (sqla_jobs/cli/relay.py)
            gc.freeze()
            published = Relay(engine, queue, space.target(routes), batch=batch).run(until_idle=True).published
        elapsed = time.perf_counter() - start
        if published != jobs:
            raise SystemExit(f"{broker}: published {published} of {jobs}")
        return jobs / elapsed
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
        space.delete()


async def _declare(target: Any) -> None:
    await target.connect()
    await target.close()


def _in_processes(engine: Engine, space: BrokerSpace, routes: dict[str, str], batch: int, processes: int) -> int:
    env = {**os.environ, "SQLA_JOBS_URL": engine.url.render_as_string(hide_password=False),
           "SQLA_JOBS_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "sqla_jobs.cli", "relay", "--app", "tests.relay_app:queue",
               *space.cli_options(routes), "--batch", str(batch), "--until-idle"]
    started = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    lines = [p.communicate()[0] for p in started]
    return sum(int(re.search(r"published (\d+)", line).group(1)) for line in lines)  # type: ignore[union-attr]


def _runs(rates: list[float]) -> str:
    return ", ".join(f"{r:.0f}" for r in rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--brokers", default="rabbitmq,nats")
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--processes", type=int, default=0,
                        help="run N `sqla-jobs relay` processes on the queue instead of one relay in this process")
    parser.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                        help="skip the client's ceiling (relay_ceiling.py) in each run")
    args = parser.parse_args()
    brokers = [b for b in args.brokers.split(",") if b]
    how = f"{args.processes} relay process(es)" if args.processes else "one relay in this process"
    print(f"relay throughput: {args.jobs} jobs per run, batch {args.batch}, {how}, {args.runs} run(s); "
          f"RabbitMQ {RABBITMQ_URL.split('@')[-1]}, NATS {NATS_URL}")
    results: dict[str, list[float]] = {b: [] for b in brokers}
    ceilings: dict[str, list[float]] = {b: [] for b in brokers}
    turn = 0
    for run in range(args.runs):
        for broker in brokers if run % 2 == 0 else reversed(brokers):  # alternate who goes first
            # The relay and its client's ceiling back to back, alternating which goes first, so both
            # see the same machine (it is shared: its load moves from minute to minute).
            steps = ["relay", "ceiling"] if args.ceiling else ["relay"]
            for step in steps if turn % 2 == 0 else reversed(steps):
                if step == "relay":
                    rate = one_run(args.url, broker, args.jobs, args.batch, args.processes)
                    results[broker].append(rate)
                    print(f"  run {run + 1} {broker:8s} relay   {rate:8.0f} jobs/s", flush=True)
                else:
                    rate = ceiling(broker, args.jobs)
                    ceilings[broker].append(rate)
                    print(f"  run {run + 1} {broker:8s} ceiling {rate:8.0f} msgs/s", flush=True)
            turn += 1
    for broker, rates in results.items():
        line = f"{broker:8s} relay median {statistics.median(rates):8.0f} jobs/s  (runs: {_runs(rates)})"
        if ceilings[broker]:
            top = statistics.median(ceilings[broker])
            line += (f"; ceiling median {top:8.0f} msgs/s (runs: {_runs(ceilings[broker])}); "
                     f"ratio {statistics.median(rates) / top:.2f}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
