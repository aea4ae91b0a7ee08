"""Raw-SQL baselines for the comparison: what PostgreSQL itself allows, with psycopg and no queue library.

::

    python docs/bench/raw_sql.py --dsn postgresql://postgres@127.0.0.1:5432/test --schema raw_scratch

Works in ``--schema`` (which must exist; the caller drops it afterwards) on a
``jobs`` table shaped like the article the project started from (bigserial id,
kind, jsonb payload, run_at, attempts, max_attempts, locked_at, finished_at,
last_error, and a partial index on run_at for unfinished jobs). Measures:

* ``claim1_drain``: one process claims one job (``UPDATE ... WHERE id = (SELECT
  ... FOR UPDATE SKIP LOCKED LIMIT 1)``), commits, marks it finished, commits;
* ``claim100_drain``: ``--processes`` processes each claim up to 100 jobs with a
  materialised CTE + ``FOR UPDATE SKIP LOCKED``, commit, finish them with one
  ``UPDATE ... WHERE id = ANY(...)``, commit; the clock runs from releasing the
  (already connected) processes until the last one finds nothing left;
* ``single_insert``: one INSERT per explicit transaction (BEGIN, INSERT, COMMIT),
  and ``single_insert_autocommit``: one INSERT per round trip in autocommit;
* ``copy_insert``: ``--jobs`` rows with COPY in one transaction.

All figures are jobs per second. Prints one JSON line.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import psycopg
from _child import base_parser, emit, log
from psycopg import sql

DDL = """
CREATE TABLE jobs (
  id           bigserial PRIMARY KEY,
  kind         text NOT NULL,
  payload      jsonb NOT NULL,
  run_at       timestamptz NOT NULL DEFAULT now(),
  attempts     int NOT NULL DEFAULT 0,
  max_attempts int NOT NULL DEFAULT 5,
  locked_at    timestamptz,
  finished_at  timestamptz,
  last_error   text
);
CREATE INDEX jobs_pending ON jobs (run_at) WHERE finished_at IS NULL;
"""

CLAIM_ONE = """
UPDATE jobs SET locked_at = now(), attempts = attempts + 1
WHERE id = (
  SELECT id FROM jobs
  WHERE finished_at IS NULL AND locked_at IS NULL AND run_at <= now()
  ORDER BY run_at LIMIT 1
  FOR UPDATE SKIP LOCKED
)
RETURNING id
"""

# MATERIALIZED keeps the planner from inlining the CTE, which could make LIMIT apply per
# re-evaluation and claim more rows than asked for.
CLAIM_BATCH = """
WITH picked AS MATERIALIZED (
  SELECT id FROM jobs
  WHERE finished_at IS NULL AND locked_at IS NULL AND run_at <= now()
  ORDER BY run_at LIMIT %s
  FOR UPDATE SKIP LOCKED
)
UPDATE jobs SET locked_at = now(), attempts = jobs.attempts + 1
FROM picked WHERE jobs.id = picked.id
RETURNING jobs.id
"""

FINISH_ONE = "UPDATE jobs SET finished_at = now() WHERE id = %s"
FINISH_MANY = "UPDATE jobs SET finished_at = now() WHERE id = ANY(%s)"
INSERT_ONE = "INSERT INTO jobs (kind, payload) VALUES ('noop', %s)"


def connect(dsn: str, schema: str, autocommit: bool = False) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=autocommit, options=f"-csearch_path={schema}")


def reset(dsn: str, schema: str) -> None:
    with connect(dsn, schema, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS jobs")
        conn.execute(DDL)


def fill(dsn: str, schema: str, n: int) -> None:
    with connect(dsn, schema) as conn:
        conn.execute(
            "INSERT INTO jobs (kind, payload) SELECT 'noop', '{}'::jsonb FROM generate_series(1, %s)", (n,)
        )
        conn.commit()
        conn.execute("ANALYZE jobs")
        conn.commit()


def count_finished(dsn: str, schema: str) -> int:
    with connect(dsn, schema) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE finished_at IS NOT NULL").fetchone()
        return int(row[0]) if row else 0


def claim1_drain(dsn: str, schema: str, n: int) -> float:
    reset(dsn, schema)
    fill(dsn, schema, n)
    with connect(dsn, schema) as conn:
        start = time.perf_counter()
        done = 0
        while True:
            row = conn.execute(CLAIM_ONE).fetchone()
            conn.commit()
            if row is None:
                break
            conn.execute(FINISH_ONE, (row[0],))
            conn.commit()
            done += 1
        elapsed = time.perf_counter() - start
    if done != n:
        raise RuntimeError(f"claim-1 drain finished {done} jobs, expected {n}")
    return n / elapsed


def _batch_worker(dsn: str, schema: str, batch: int, ready: Any, go: Any, counts: Any, index: int) -> None:
    done = 0
    with connect(dsn, schema) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        ready.set()
        go.wait(60)
        while True:
            ids = [r[0] for r in conn.execute(CLAIM_BATCH, (batch,)).fetchall()]
            conn.commit()
            if not ids:
                break
            conn.execute(FINISH_MANY, (ids,))
            conn.commit()
            done += len(ids)
    counts[index] = done


def claim_batch_drain(dsn: str, schema: str, n: int, processes: int, batch: int) -> float:
    reset(dsn, schema)
    fill(dsn, schema, n)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(processes)]
    counts = ctx.Array("q", processes)
    procs = [
        ctx.Process(target=_batch_worker, args=(dsn, schema, batch, readies[i], go, counts, i))
        for i in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        for r in readies:
            if not r.wait(60):
                raise RuntimeError("a claim-batch process did not connect within 60 s")
        start = time.perf_counter()
        go.set()
        for p in procs:
            p.join(300)
        elapsed = time.perf_counter() - start
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a claim-batch process failed (exit codes {[p.exitcode for p in procs]})")
    total = sum(counts[:])
    if total != n or count_finished(dsn, schema) != n:
        raise RuntimeError(f"claim-{batch} drain finished {total} jobs, expected {n}")
    return n / elapsed


def single_insert(dsn: str, schema: str, n: int, autocommit: bool) -> float:
    reset(dsn, schema)
    with connect(dsn, schema, autocommit=autocommit) as conn:
        start = time.perf_counter()
        for i in range(n):
            if autocommit:
                conn.execute(INSERT_ONE, (f'{{"i": {i}}}',))
            else:
                with conn.transaction():
                    conn.execute(INSERT_ONE, (f'{{"i": {i}}}',))
        elapsed = time.perf_counter() - start
    return n / elapsed


def copy_insert(dsn: str, schema: str, n: int) -> float:
    reset(dsn, schema)
    with connect(dsn, schema) as conn:
        start = time.perf_counter()
        with conn.cursor() as cur, cur.copy(sql.SQL("COPY jobs (kind, payload) FROM STDIN")) as copy:
            for i in range(n):
                copy.write_row(("noop", f'{{"i": {i}}}'))
        conn.commit()
        elapsed = time.perf_counter() - start
    with connect(dsn, schema) as conn:
        row = conn.execute("SELECT count(*) FROM jobs").fetchone()
    if not row or row[0] != n:
        raise RuntimeError(f"COPY inserted {row[0] if row else 0} rows, expected {n}")
    return n / elapsed


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=4, help="processes for the claim-batch drain (default 4)")
    p.add_argument("--batch", type=int, default=100, help="jobs per claim in the claim-batch drain (default 100)")
    args = p.parse_args()
    result: dict[str, Any] = {"system": "raw SQL (psycopg " + psycopg.__version__ + ")"}
    log("raw: claim 1 + finish 1")
    result["claim1_drain"] = claim1_drain(args.dsn, args.schema, args.jobs)
    log(f"raw: claim {args.batch} + finish {args.batch}, {args.processes} processes")
    result["claim100_drain"] = claim_batch_drain(args.dsn, args.schema, args.jobs, args.processes, args.batch)
    log("raw: one INSERT per transaction")
    result["single_insert"] = single_insert(args.dsn, args.schema, args.single_jobs, autocommit=False)
    result["single_insert_autocommit"] = single_insert(args.dsn, args.schema, args.single_jobs, autocommit=True)
    log("raw: COPY")
    result["copy_insert"] = copy_insert(args.dsn, args.schema, args.jobs)
    emit(result)


if __name__ == "__main__":
    main()
