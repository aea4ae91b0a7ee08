"""Measure the dashboard's page render times on a big PostgreSQL table (a manual benchmark, not a test).

Builds, in a scratch schema it drops afterwards, the table of ``measure_stats.py``
(1,000,000 finished jobs over the last 7 days, 10,000 pending, 100 running,
1,000 dead) plus a full day of chart samples (one a minute, 1,440 samples),
then requests each page in-process (Starlette's test client: the time is the
app's, database included, without a network) and prints the median of several runs::

    python docs/bench/measure_dashboard.py [postgresql+psycopg://postgres@127.0.0.1:5432/test] [--runs 21]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure_stats import FILL
from starlette.testclient import TestClient

from sqla_jobs.web import dashboard, samples_table
from tests.app import Base, queue

SAMPLES = """
INSERT INTO jobs_samples (taken_at, series, label, value)
SELECT now() - make_interval(mins => m), s.series, s.label, random() * 100
FROM generate_series(1, 1440) AS m,
     (VALUES ('ready', 'default'), ('ready', 'mail'), ('scheduled', 'default'), ('scheduled', 'mail'),
             ('running', 'default'), ('running', 'mail'), ('oldest', 'default'), ('oldest', 'mail'),
             ('finished', ''), ('dead', 'kind_0'), ('dead', 'kind_1'), ('p50', 'kind_0'), ('p95', 'kind_0'),
             ('p50', 'kind_1'), ('p95', 'kind_1')) AS s(series, label);
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", nargs="?", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    schema = f"bench_dash_{uuid.uuid4().hex[:8]}"
    admin = create_engine(args.url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = make_url(args.url).update_query_dict({"options": f"-csearch_path={schema}"})
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        samples_table(queue).create(engine)
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(text(FILL))
            conn.execute(text(SAMPLES))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in ("jobs", "dead_jobs", "jobs_samples"):
                conn.execute(text(f"VACUUM ANALYZE {table}"))
            middle = conn.execute(text("SELECT id FROM jobs WHERE state = 'finished' ORDER BY id LIMIT 1 "
                                       "OFFSET 500000")).scalar()
        print(f"built 1,000,000 finished + 10,000 pending + 100 running + 1,000 dead + 21,600 sample rows "
              f"in {time.perf_counter() - started:.1f}s")
        web = TestClient(dashboard(engine, queue))
        pages = [
            ("overview /", "/"),
            ("live figures /figures", "/figures"),
            ("chart data, last hour", "/api/series?span=hour"),
            ("chart data, last day", "/api/series?span=day"),
            ("jobs, first page", "/jobs"),
            ("jobs, state=pending", "/jobs?state=pending"),
            ("jobs, state=finished kind=kind_3", "/jobs?state=finished&kind=kind_3"),
            ("jobs, page at the 500,000th row", f"/jobs?before={middle}"),
            ("jobs, created within 1h", "/jobs?since=1h"),
            ("jobs, unique_key=order-7", "/jobs?unique_key=order-7"),
            (f"one job /jobs/{middle}", f"/jobs/{middle}"),
            ("dead letters", "/dead"),
        ]
        for label, path in pages:
            assert web.get(path).status_code == 200, path  # warm the pool, the cache and the first sample
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                response = web.get(path)
                times.append(time.perf_counter() - t0)
                assert response.status_code == 200
            print(f"{label:38} median {statistics.median(times) * 1000:6.1f} ms  "
                  f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}, {args.runs} runs)")
        engine.dispose()
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
