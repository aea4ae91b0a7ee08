"""Measure the dashboard's page render times on a big PostgreSQL table (a manual benchmark, not a test).

Builds, in a scratch schema it drops afterwards, the table of ``measure_stats.py``
(1,000,000 finished jobs over the last 7 days, 10,000 pending, 100 running,
1,000 dead) plus a full day of chart samples (one a minute, 1,440 samples), in
two layouts:

* ``newest``: the pending jobs are the newest rows (inserted last), as in ``measure_stats.py``;
* ``oldest``: the pending jobs are the *oldest* rows, due for a week (a queue whose worker has been
  down for a week: the day the "oldest pending age" alarm sends someone to the jobs page). A list
  that walks the primary key and filters shows it: it reads the million finished rows first.

Then it requests each page and every list the dashboard links to (state,
queue, kind, unique key, since, their combinations, the next page) in-process
(Starlette's test client: the time is the app's, database included, without a
network) and prints the median of several runs::

    python docs/bench/measure_dashboard.py [postgresql+psycopg://postgres@127.0.0.1:5432/test] [--runs 21]
        [--layout oldest|newest|both]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import Engine, create_engine, make_url, text

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

# measure_stats' statements: finished, pending, running, dead (in that order, so the pending rows are newest).
FINISHED, PENDING, RUNNING, DEAD = (s.strip() for s in FILL.split(";") if s.strip())
# The pending jobs of a worker down for a week: created and due 7 days ago (10% in queue `mail`).
PENDING_WEEK_OLD = """
INSERT INTO jobs (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts)
SELECT 'kind_' || (i % 5), CASE WHEN i % 10 = 0 THEN 'mail' ELSE 'default' END, '{"n": 1}', 0, 'pending',
       now() - interval '7 days' + make_interval(secs => i), now() - interval '7 days' + make_interval(secs => i),
       0, 5
FROM generate_series(1, 10000) AS i
"""
LAYOUTS = {"newest": (FINISHED, PENDING, RUNNING, DEAD), "oldest": (PENDING_WEEK_OLD, RUNNING, FINISHED, DEAD)}


def build(engine: Engine, layout: str) -> None:
    """The tables of ``layout``, vacuumed and analysed as autovacuum would leave them."""
    Base.metadata.create_all(engine)
    samples_table(queue).create(engine)
    started = time.perf_counter()
    with engine.begin() as conn:
        for statement in LAYOUTS[layout]:
            conn.execute(text(statement))
        conn.execute(text(SAMPLES))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("jobs", "dead_jobs", "jobs_samples"):
            conn.execute(text(f"VACUUM ANALYZE {table}"))
    print(f"layout {layout!r} (pending rows {layout}): built 1,000,000 finished + 10,000 pending + 100 running "
          f"+ 1,000 dead + 21,600 sample rows in {time.perf_counter() - started:.1f}s")


def lists(engine: Engine) -> list[tuple[str, str]]:
    """Every page, and every list the dashboard links to, as (label, path)."""
    with engine.connect() as conn:
        middle = conn.execute(text("SELECT id FROM jobs WHERE state = 'finished' ORDER BY id LIMIT 1 "
                                   "OFFSET 500000")).scalar()
    return [
        ("overview /", "/"),
        ("live figures /figures", "/figures"),
        ("chart data, last hour", "/api/series?span=hour"),
        ("chart data, last day", "/api/series?span=day"),
        ("jobs, first page", "/jobs"),
        ("jobs, page at the 500,000th row", f"/jobs?before={middle}"),
        ("state=pending", "/jobs?state=pending"),
        ("state=pending, its 100th page", "PAGE100:/jobs?state=pending"),
        ("state=running", "/jobs?state=running"),
        ("state=finished", "/jobs?state=finished"),
        ("state=cancelled (none)", "/jobs?state=cancelled"),
        ("queue=mail", "/jobs?queue=mail"),
        ("queue=mail&state=pending (overview link)", "/jobs?queue=mail&state=pending"),
        ("queue=default&state=running", "/jobs?queue=default&state=running"),
        ("kind=kind_3", "/jobs?kind=kind_3"),
        ("kind=kind_3&state=pending (overview link)", "/jobs?kind=kind_3&state=pending"),
        ("kind=kind_3&state=finished", "/jobs?state=finished&kind=kind_3"),
        ("kind=kind_3&queue=mail&state=pending", "/jobs?kind=kind_3&queue=mail&state=pending"),
        ("unique_key=order-7", "/jobs?unique_key=order-7"),
        ("unique_key=order-7&state=pending", "/jobs?unique_key=order-7&state=pending"),
        ("since=1h", "/jobs?since=1h"),
        ("since=1h&state=finished&kind=kind_3", "/jobs?since=1h&state=finished&kind=kind_3"),
        ("since=1h&state=pending", "/jobs?since=1h&state=pending"),
        ("since=1h&queue=mail", "/jobs?since=1h&queue=mail"),
        (f"one job /jobs/{middle}", f"/jobs/{middle}"),
        ("dead letters", "/dead"),
    ]


def follow(web: TestClient, path: str, pages: int) -> str:
    """The path of the ``pages``-th page of a list, by its "Older jobs" links."""
    for _ in range(pages - 1):
        found = re.search(r'id="next" href="[^"]*(/jobs\?[^"]+)"', web.get(path).text)
        assert found, f"{path} has no next page"
        path = found.group(1).replace("&amp;", "&")
    return path


def measure(engine: Engine, runs: int) -> dict[str, float]:
    web = TestClient(dashboard(engine, queue))
    medians = {}
    for label, path in lists(engine):
        if path.startswith("PAGE100:"):
            path = follow(web, path.removeprefix("PAGE100:"), 100)
        assert web.get(path).status_code == 200, path  # warm the pool, the cache and the first sample
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            response = web.get(path)
            times.append(time.perf_counter() - t0)
            assert response.status_code == 200
        medians[label] = statistics.median(times) * 1000
        print(f"  {label:44} median {medians[label]:6.1f} ms  "
              f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}, {runs} runs)", flush=True)
    return medians


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url", nargs="?", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--layout", choices=("oldest", "newest", "both"), default="both")
    parser.add_argument("--keep", action="store_true", help="keep the scratch schema (prints its name)")
    args = parser.parse_args()
    admin = create_engine(args.url)
    for layout in ("oldest", "newest") if args.layout == "both" else (args.layout,):
        schema = f"bench_dash_{uuid.uuid4().hex[:8]}"
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        try:
            url = make_url(args.url).update_query_dict({"options": f"-csearch_path={schema}"})
            engine = create_engine(url)
            build(engine, layout)
            measure(engine, args.runs)
            engine.dispose()
        finally:
            if args.keep:
                print(f"kept schema {schema}")
            else:
                with admin.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
