"""What one worker turn costs with a limit: ``Store.finish_and_claim`` timed alone, no handlers, no threads.

A manual benchmark, not a test (issue 13, point 10)::

    python docs/bench/limits_turn.py --url postgresql+psycopg://user@host/db [--jobs 20000] [--batch 16]
    LIMITS_DRAIN_LIMIT=none python docs/bench/limits_turn.py --url ...   # the same app without its limit

On ``--jobs`` jobs of ``limits_drain``'s kind ``capped`` (``limit=32``), one connection finishes the
last batch and claims the next (``--batch`` jobs), turn after turn until the queue is empty, once
without the claim of the other kinds (``plain=False``, a worker's usual turn while the limited
backlog lasts) and once with it. Prints the median and mean time per turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent))

import limits_drain as drain  # the app, beside this file

from sqla_jobs.worker.executor import Outcome
from sqla_jobs.worker.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    engine = create_engine(args.url)
    for plain in (False, True):
        drain.Base.metadata.drop_all(engine)
        drain.queue.create_tables(engine)
        with Session(engine) as session, session.begin():
            drain.queue.enqueue_many(session, [{"kind": "capped"} for _ in range(args.jobs)])
        store = Store(engine, drain.queue, drain.queue.driver(engine), "bench", 60.0, None)
        store.prepare(False, 1.0)
        done: list[Outcome] = []
        times: list[float] = []
        while True:
            started = time.perf_counter()
            jobs, _, _ = store.finish_and_claim(done, args.batch, f"t{len(times):x}", alone=False, plain=plain)
            times.append(time.perf_counter() - started)
            if not jobs:
                break
            done = [Outcome(job, "ok", 0.0) for job in jobs]
        store.close()
        print(f"plain={plain}: {len(times)} turns, median {statistics.median(times) * 1000:.2f} ms, "
              f"mean {statistics.mean(times) * 1000:.2f} ms per turn of {args.batch} jobs", flush=True)
    drain.Base.metadata.drop_all(engine)
    engine.dispose()


if __name__ == "__main__":
    main()
