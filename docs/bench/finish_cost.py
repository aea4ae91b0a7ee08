"""What the finish costs per job on the real jobs table, three ways (issue 31, part 2: finished rows kept).

::

    python docs/bench/finish_cost.py --url postgresql+psycopg://postgres@127.0.0.1:5432/test --jobs 30000 --runs 3

In a scratch schema it creates the jobs table as ``create-tables`` does (the bench app's model, every index),
fills it with ``--jobs`` running jobs, and finishes them in batches of ``--batch`` on one autocommit connection,
three ways, taking turns:

* ``update``: what the worker does today, the row kept (``state = 'finished'``, ``finished_at``, the lease cleared).
  Not a HOT update: ``state`` is in the partial indexes' predicates, so the row is written again whole and a new
  entry goes into every index that holds finished rows;
* ``delete``: ``--discard-finished``, the row gone;
* ``move``: the row deleted and inserted into a history table of the same shape (primary key only), in one
  statement: what a finish would cost if finished jobs lived in a table of their own;
* ``hot``: today's ``UPDATE`` on a copy of the table (``jobs_hot``, fillfactor 70) whose only indexes are the
  primary key and a claim index whose predicate names a column the finish leaves alone
  (``claim_token IS NULL``): a finish that may be a HOT update, the best a redesign of the indexes could do.
  The share of its updates PostgreSQL made HOT is printed beside it.

For each, the median microseconds per job and the WAL bytes per job (``pg_current_wal_lsn`` before and after: the
cluster's, so run it on a server nothing else writes to meanwhile).
The scratch schema is dropped afterwards. Prints a table, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import psycopg
from sqlalchemy import create_engine, make_url, text

from sqla_jobs.bench.app import queue

_UPDATE = ("UPDATE {table} SET state = 'finished', finished_at = now(), lease_expires_at = NULL "
           "WHERE id = ANY(%s) RETURNING id")
FINISHES = {  # the table each way finishes its jobs in, and its statement
    "update": ("jobs", _UPDATE.format(table="jobs")),
    "delete": ("jobs", "DELETE FROM jobs WHERE id = ANY(%s) RETURNING id"),
    "move": ("jobs", "WITH moved AS (DELETE FROM jobs WHERE id = ANY(%s) RETURNING *) "
                     "INSERT INTO jobs_history SELECT * FROM moved RETURNING id"),
    "hot": ("jobs_hot", _UPDATE.format(table="jobs_hot")),
}
FILL = """
INSERT INTO {table} (kind, queue, payload, priority, state, run_at, created_at, attempts, max_attempts,
                  locked_at, locked_by, claim_token, lease_expires_at, isolate)
SELECT 'send_email', 'default', '{"to": "someone@example.com", "n": 1}', 0, 'running', now(), now(), 1, 20,
       now(), 'bench', 'token-' || g, now() + interval '1 minute', false
FROM generate_series(1, %s) g
"""


def measure(url: str, jobs: int, batch: int, runs: int) -> dict[str, Any]:
    schema = f"bench_finish_{uuid.uuid4().hex[:8]}"
    base = make_url(url)
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    scratch = create_engine(base.update_query_dict({"options": f"-csearch_path={schema}"}))
    try:
        queue.create_tables(scratch)
        with scratch.begin() as conn:
            conn.execute(text("CREATE TABLE jobs_history (LIKE jobs INCLUDING DEFAULTS)"))
            conn.execute(text("ALTER TABLE jobs_history ADD PRIMARY KEY (id)"))
            conn.execute(text("CREATE TABLE jobs_hot (LIKE jobs INCLUDING DEFAULTS) WITH (fillfactor = 70)"))
            conn.execute(text("ALTER TABLE jobs_hot ADD PRIMARY KEY (id)"))
            conn.execute(text("CREATE INDEX ix_jobs_hot_pending ON jobs_hot (priority DESC, run_at, id) "
                              "WHERE claim_token IS NULL"))
        scratch.dispose()
        dsn = base.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(dsn, autocommit=True, options=f"-csearch_path={schema}") as conn:
            return _rounds(conn, jobs, batch, runs)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def _rounds(conn: psycopg.Connection[Any], jobs: int, batch: int, runs: int) -> dict[str, Any]:
    us: dict[str, list[float]] = {name: [] for name in FINISHES}
    wal: dict[str, list[float]] = {name: [] for name in FINISHES}
    hot: dict[str, list[float]] = {name: [] for name in FINISHES}
    for run in range(runs):
        for name in list(FINISHES) if run % 2 == 0 else list(reversed(FINISHES)):  # turns, reversed each round
            table, statement = FINISHES[name]
            conn.execute(FILL.replace("{table}", table), (jobs,))  # type: ignore[arg-type]
            conn.execute(f"VACUUM ANALYZE {table}")  # type: ignore[arg-type]
            ids = [row[0] for row in conn.execute(f"SELECT id FROM {table} ORDER BY id")]  # type: ignore[arg-type]
            hot_before = _hot_updates(conn, table)
            start_lsn = _lsn(conn)
            started = time.perf_counter()
            done = 0
            for i in range(0, len(ids), batch):
                done += len(conn.execute(statement, (ids[i:i + batch],)).fetchall())  # type: ignore[arg-type]
            elapsed = time.perf_counter() - started
            if done != len(ids):
                raise RuntimeError(f"{name}: finished {done} of {len(ids)} jobs")
            row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (start_lsn,)).fetchone()
            assert row is not None
            us[name].append(elapsed / len(ids) * 1e6)
            wal[name].append(float(row[0]) / len(ids))
            hot[name].append((_hot_updates(conn, table) - hot_before) / len(ids))
            conn.execute("TRUNCATE jobs, jobs_history, jobs_hot")
    return {name: {"us_per_job": statistics.median(us[name]), "us_runs": [round(v, 2) for v in us[name]],
                   "wal_bytes_per_job": statistics.median(wal[name]), "hot_share": statistics.median(hot[name])}
            for name in FINISHES}


def _hot_updates(conn: psycopg.Connection[Any], table: str) -> int:
    """The table's HOT updates so far, this session's included (PostgreSQL 15 reports them on a flush)."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT 1")  # the statement after which the flush happens
    row = conn.execute("SELECT n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
                       (table,)).fetchone()
    return int(row[0]) if row is not None else 0


def _lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--url", required=True, help="PostgreSQL URL, e.g. postgresql+psycopg://postgres@127.0.0.1/test")
    p.add_argument("--jobs", type=int, default=30_000, help="running jobs finished per measurement")
    p.add_argument("--batch", type=int, default=64, help="jobs per finish statement (the worker's claim batch)")
    p.add_argument("--runs", type=int, default=3, help="rounds; each finishes --jobs jobs each way")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args()
    result = measure(args.url, args.jobs, args.batch, args.runs)
    if args.json:
        print(json.dumps(result))
        return
    print("| finish | us/job (median) | runs | WAL bytes/job | HOT updates |\n|---|---|---|---|---|")
    for name, r in result.items():
        runs = " · ".join(f"{v:.1f}" for v in r["us_runs"])
        print(f"| {name} | {r['us_per_job']:.1f} | {runs} | {r['wal_bytes_per_job']:.0f} | {r['hot_share']:.0%} |")


if __name__ == "__main__":
    main()
