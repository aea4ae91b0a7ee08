"""Measure ``queue.stats`` on a big PostgreSQL table (a manual benchmark, not a test).

Builds, in a scratch schema it drops afterwards, the issue's table: 1,000,000
finished jobs spread over the last 7 days, 10,000 pending (half due, half
scheduled), 100 running and 1,000 dead; then prints the median time of
several ``stats`` calls and the plans of its queries::

    python docs/bench/measure_stats.py [postgresql+psycopg://postgres@127.0.0.1:5432/test] [--runs 11]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.app import Base, queue

FILL = """
INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts,
                  locked_at, finished_at)
SELECT 'kind_' || (i % 5), 'default', '{"n": 1}', 0, 'finished',
       t - make_interval(secs => 1 + (i % 7)), t - make_interval(secs => 2 + (i % 7)), 1, 5,
       t - make_interval(secs => (i % 100) / 20.0), t
FROM (SELECT i, now() - make_interval(secs => i * 0.6048) AS t FROM generate_series(1, 1000000) AS i) AS s;

INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts)
SELECT 'kind_' || (i % 5), CASE WHEN i % 10 = 0 THEN 'mail' ELSE 'default' END, '{"n": 1}', 0, 'pending',
       CASE WHEN i % 2 = 0 THEN now() - make_interval(secs => i % 600) ELSE now() + make_interval(secs => i) END,
       now() - interval '1 hour', 0, 5
FROM generate_series(1, 10000) AS i;

INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts, locked_at,
                  locked_by, claim_token, lease_expires_at)
SELECT 'kind_' || (i % 5), 'default', '{}', 0, 'running', now() - interval '10 seconds', now(), 1, 5, now(),
       'bench', md5(i::text), now() + interval '60 seconds'
FROM generate_series(1, 100) AS i;

INSERT INTO dead_jobs (id, kind, queue, payload, priority, attempts, max_attempts, created_at, run_at, last_error,
                       errors, failed_at)
SELECT 2000000 + i, 'kind_' || (i % 5), 'default', '{}', 0, 5, 5, now(), now(), 'boom', '[]',
       now() - make_interval(secs => i * 60)
FROM generate_series(1, 1000) AS i;
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", nargs="?", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args()
    schema = f"bench_stats_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = make_url(args.url).update_query_dict({"options": f"-csearch_path={schema}"})
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(text(FILL))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE jobs"))
            conn.execute(text("VACUUM ANALYZE dead_jobs"))
            size = conn.execute(text("SELECT pg_size_pretty(pg_total_relation_size('jobs'))")).scalar()
        print(f"built 1,000,000 finished + 10,000 pending + 100 running + 1,000 dead in "
              f"{time.perf_counter() - started:.1f}s; jobs table with indexes: {size}")
        for label, kw in (("stats() [1h window]", {}), ("stats(run_times=False) [scrape/health]",
                                                       {"run_times": False}),
                          ("stats(window=7d) [every finished row in the window]", {"window": 7 * 86400.0})):
            queue.stats(engine, **kw)  # warm the pool and the cache
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                s = queue.stats(engine, **kw)
                times.append(time.perf_counter() - t0)
            print(f"{label}: median {statistics.median(times) * 1000:.1f} ms over {args.runs} runs "
                  f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}); ready={s.ready} "
                  f"scheduled={s.scheduled} running={s.running} finished={s.finished} dead={s.dead_total}")
        driver = queue.driver(engine)
        with engine.connect() as conn:
            captured = []
            real = conn.execute

            def capture(stmt, *a, **k):  # type: ignore[no-untyped-def]
                captured.append(stmt)
                return real(stmt, *a, **k)

            conn.execute = capture  # type: ignore[method-assign]
            driver.pending_by_queue(conn)
            driver.running_by_queue(conn)
            driver.dead_by_kind(conn, 3600)
            driver.run_times(conn, 3600)
            conn.execute = real  # type: ignore[method-assign]
            for stmt in captured:
                compiled = stmt.compile(conn, compile_kwargs={"literal_binds": True})
                plan = [r[0] for r in conn.execute(text(f"EXPLAIN (ANALYZE, BUFFERS OFF, COSTS OFF) {compiled}"))]
                print("\n" + "\n".join(plan))
        engine.dispose()
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
