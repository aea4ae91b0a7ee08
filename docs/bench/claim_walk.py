"""How far the claim walks the pending index during a large drain, second by second (PostgreSQL).

    python docs/bench/claim_walk.py --url postgresql+psycopg://postgres@127.0.0.1/test --jobs 300000
        [--vacuum-every 2] [--vacuum-dead-rows 50000]

Enqueues ``--jobs`` no-op jobs with the workers down, starts 2 worker processes (64 threads each, as
``sqla-jobs bench`` does) and prints, once a second: the drain rate, the jobs left, and what an
``EXPLAIN (ANALYZE, BUFFERS)`` of the claim's index walk (its ``due`` step without the lock) read to
find 64 pending jobs, with the checkpoints and VACUUMs so far and the server's dead-row count.
``--vacuum-every S`` runs ``VACUUM`` from this script every S seconds (autovacuum's work, done at
once); ``--vacuum-dead-rows N`` runs the workers as ``sqla-jobs worker --vacuum-dead-rows N``.
docs/performance.md ("Large backlogs") shows what it printed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from sqla_jobs.bench import run as bench

WALK = """EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
SELECT id FROM jobs WHERE state = 'pending' AND run_at <= now() ORDER BY priority DESC, run_at, id LIMIT 64"""
COUNTERS = """SELECT (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter),
    s.vacuum_count, s.n_dead_tup FROM pg_stat_user_tables AS s WHERE s.relid = to_regclass('jobs')"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--jobs", type=int, default=300_000)
    p.add_argument("--vacuum-every", type=float, default=0.0, metavar="S")
    p.add_argument("--vacuum-dead-rows", type=int, default=None, metavar="N")
    args = p.parse_args()
    with bench.scratch(make_url(args.url)) as url:
        engine = create_engine(url)
        bench._reset(engine)
        with Session(engine) as session, session.begin():
            bench.queue.enqueue_many(session, ({"kind": "noop", "payload": {}} for _ in range(args.jobs)))
        with engine.connect() as conn:
            checkpoints_before = conn.execute(text(COUNTERS)).first()[0]  # type: ignore[index]
        ctx = mp.get_context("spawn")
        readies = [ctx.Event() for _ in range(2)]
        rendered = url.render_as_string(hide_password=False)
        workers = [ctx.Process(target=bench._worker_main,
                               args=(rendered, 64, ready, 100, False, args.vacuum_dead_rows)) for ready in readies]
        for worker in workers:
            worker.start()
        for ready in readies:
            ready.wait(60)
        start = last_vacuum = time.perf_counter()
        left_before, then = args.jobs, start
        while left_before:
            time.sleep(1.0)
            now = time.perf_counter()
            left = bench._count_unfinished(engine)
            with engine.connect() as conn:
                conn.execute(text("SET enable_bitmapscan = off; SET enable_seqscan = off"))  # the claim's plan
                plan = conn.execute(text(WALK)).scalar_one()[0]
                checkpoints, vacuums, dead = conn.execute(text(COUNTERS)).one()
                conn.rollback()
            node = plan["Plan"]["Plans"][0] if "Plans" in plan["Plan"] else plan["Plan"]
            buffers = node["Shared Hit Blocks"] + node["Shared Read Blocks"]
            print(f"t={now - start:5.1f}s rate={(left_before - left) / (now - then):7.0f}/s left={left:7d} "
                  f"walk={plan['Execution Time']:.2f}ms buffers={buffers} "
                  f"(read {node['Shared Read Blocks']}) checkpoints={checkpoints - checkpoints_before} "
                  f"vacuums={vacuums} dead={dead}", flush=True)
            left_before, then = left, now
            if args.vacuum_every and now - last_vacuum >= args.vacuum_every:
                with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    conn.execute(text("VACUUM jobs"))
                last_vacuum = now
        print(f"drain: {args.jobs / (time.perf_counter() - start):.0f} jobs/s", flush=True)
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.join(30)
        engine.dispose()


if __name__ == "__main__":
    main()
