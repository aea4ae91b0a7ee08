"""PostgreSQL: the claim of a kind with a plain running limit (no key, no rate) in one round trip.

The portable claim (``drivers._limits``) reads, locks the kind's row, counts,
selects and updates: five round trips, four under the lock. Here the same
steps are two statements sent together in one psycopg pipeline:

1. **Lock**: ``SELECT … FOR UPDATE`` of the kind's limits row, only if a job
   of the kind is due and fewer than the limit run (the portable path's
   ``_worth_locking``, folded into the lock's ``WHERE``: a "no" is safe
   without the lock for the reasons given there). Only once the row is
   locked does it mark the transaction with ``set_config('sqla_jobs.locked',
   <row>, true)``: the ``set_config`` is computed on the rows the CTE returns,
   and those come out of its ``LockRows`` step.
2. **Count and take**: a CTE counts the kind's running jobs and claims at most
   ``least(free, limit - running)`` due jobs, ``FOR UPDATE SKIP LOCKED``, in one
   ``UPDATE … RETURNING``; 0 unless step 1 marked the transaction as holding
   this kind's row.

Why two statements and not one: under READ COMMITTED a statement sees the
commits made before it *began*; a count in the locking statement would be
taken before it waited for the lock, so two claimers could count the same
running jobs. Why one pipeline is still safe: the server reads the pipeline's
messages in order and starts statement 2 (its Bind takes the snapshot) only
after statement 1's Execute returned, that is after the lock was granted, so
its count sees every claim committed by the holders before it.
(``tests/drivers/test_limits.py::test_concurrent_claimers_never_exceed_the_limit`` and the
``plain`` case of ``tests/test_limits.py::test_four_processes_never_run_more_than_the_limit`` fail when
the count moves into step 1; ``test_postgresql_takes_nothing_without_the_lock_its_first_statement_passed_up``
when step 2 ignores the mark.)

The threads a claim may fill (``free``) are shared by the kinds in kind order:
step 2 subtracts what the claim, known by its token (one per claim), already
took in the transaction; an isolated job taken alone leaves nothing for the
kinds after it.

When every limit of the app is plain, the worker's whole turn is one pipeline
on its autocommit connection (``finish_and_claim_capped``): BEGIN, its
finishes, steps 1 and 2 for each limited kind, the claim of the other kinds
for the threads left (the worker's own statement, its ``LIMIT`` less what the
token took), COMMIT. A kind's row is then held for the server's time to run
what follows its lock, and no network round trip.

The row must exist: when it does not (the kind's first claim ever), step 1
says so, step 2 takes nothing, and the row is made the portable way
(``drivers._limits``); workers make their kinds' rows when they start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Table
from sqlalchemy.exc import DBAPIError
from sqlalchemy.util import await_only

from ..base import Claimed
from . import partitions
from .claim import _CLAIM_PLANNER, _CLAIM_PLANNER_UNDO, CLAIMED, in_transaction, is_async
from .notify import pg_name

if TYPE_CHECKING:
    import psycopg

__all__ = ["Statements", "claim_capped", "finish_and_claim_capped", "statements"]

_LOCK = """
WITH locked AS MATERIALIZED (
    SELECT name FROM {limits}
    WHERE name = %(row)s
        AND EXISTS (SELECT FROM {live} WHERE state = 'pending' AND run_at <= now() AND kind = %(kind)s{queue_filter})
        AND (SELECT count(*) FROM {table} WHERE state = 'running' AND kind = %(kind)s) < %(running)s
    FOR UPDATE
)
SELECT set_config('sqla_jobs.locked', name, true) FROM locked
UNION ALL
SELECT NULL WHERE NOT EXISTS (SELECT FROM {limits} WHERE name = %(row)s)
"""

# `alone` / the rows with `claimed` NULL: the isolated jobs, as in the ordinary claim (postgresql.py).
_TAKE = """
WITH cap AS (
    SELECT CASE WHEN current_setting('sqla_jobs.locked', true) = %(row)s
        THEN least(%(budget)s - {taken},
                   %(running)s - (SELECT count(*) FROM {table} WHERE state = 'running' AND kind = %(kind)s))
        ELSE 0 END AS n
), due AS MATERIALIZED (
    SELECT id, isolate, priority, run_at FROM {live}
    WHERE state = 'pending' AND run_at <= now() AND kind = %(kind)s{queue_filter}
    ORDER BY priority DESC, run_at, id
    LIMIT (SELECT greatest(n, 0) FROM cap)
    FOR UPDATE SKIP LOCKED
), alone AS (
    SELECT id FROM due WHERE isolate AND %(alone)s AND {nothing_taken} ORDER BY priority DESC, run_at, id LIMIT 1
), """ + CLAIMED + """UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM due
WHERE isolate AND id NOT IN (SELECT id FROM alone)
"""

# What this claim (its token: one per claim) took earlier in the transaction, from kinds before this one:
# a budget of `free` threads is shared in kind order, and an isolated job taken alone ends the claim.
_TAKEN = ("(SELECT CASE WHEN bool_or(isolate) THEN %(budget)s ELSE count(*) END FROM {live} "
          "WHERE state = 'running' AND claim_token = %(token)s)")
_NOTHING_TAKEN = "NOT EXISTS (SELECT FROM {live} WHERE state = 'running' AND claim_token = %(token)s)"


class Statements:
    """The statements of one jobs table (with or without a queue filter; plain or partitioned)."""

    def __init__(self, jobs: Table, limits: Table, by_queue: bool, parted: bool, hot: str) -> None:
        live = partitions.live_name(jobs) if parted else pg_name(jobs)
        names = {"table": pg_name(jobs), "live": live, "limits": pg_name(limits),
                 "queue_filter": " AND queue = ANY(%(queues)s::text[])" if by_queue else ""}
        names |= {"taken": _TAKEN.format(**names), "nothing_taken": _NOTHING_TAKEN.format(**names)}
        self.lock = _LOCK.format(**names)
        self.take = _TAKE.format(**names)
        #: The ordinary claim (``hot``: the worker's statement, skipping the limited kinds) for the threads the
        #: limited kinds left, after them in the same transaction.
        self.rest = hot.replace("LIMIT %(limit)s\n", f"LIMIT greatest(%(limit)s - {names['taken']}, 0)\n", 1)
        self.rest = self.rest.replace("isolate AND %(alone)s ", f"isolate AND %(alone)s AND {names['nothing_taken']} ",
                                      1)
        assert self.rest.count(names["taken"]) == self.rest.count(names["nothing_taken"]) == 1, "hot statement changed"


_CACHE: dict[tuple[str, str, bool, bool], Statements] = {}


def statements(conn: Connection, jobs: Table, limits: Table, by_queue: bool, hot: str) -> Statements:
    parted = partitions.is_partitioned(conn, jobs)
    key = (jobs.fullname, limits.fullname, by_queue, parted)
    if key not in _CACHE:
        _CACHE[key] = Statements(jobs, limits, by_queue, parted, hot)
    return _CACHE[key]


def _rows(conn: Connection, work: list[tuple[str, Any]], own: bool) -> list[list[Any]]:
    """``_run`` on ``conn``'s psycopg connection (awaited under the async worker), errors as SQLAlchemy's
    (what the worker's retry loop expects)."""
    raw = conn.connection.driver_connection
    try:
        if is_async(raw):  # the async worker: we run in its control greenlet
            return list(await_only(_run_async(raw, work, own)))
        return _run(raw, work, own)
    except Exception as exc:
        if isinstance(exc, conn.dialect.loaded_dbapi.Error):
            raise DBAPIError.instance("claim of limited kinds", None, exc, conn.dialect.loaded_dbapi.Error) from exc
        raise


def claim_capped(conn: Connection, stmts: Statements, row: str, kind: str, running: int, budget: int,
                 worker: str, token: str, lease: float, queues: Sequence[str] | None,
                 alone: bool) -> tuple[list[Claimed], bool] | None:
    """Claim jobs of ``kind`` (at most ``running`` at once) in ``conn``'s transaction (``drivers._limits``).

    ``budget`` and ``alone`` are those of the whole claim (``token``): what it took of the kinds before is
    counted by the statement. Returns (claimed, isolated_waiting), or None when the kind's limits row does
    not exist yet.
    """
    params = {"row": row, "kind": kind, "running": running, "budget": budget, "worker": worker, "token": token,
              "lease": float(lease), "queues": list(queues or ()), "alone": alone}
    if not conn.in_transaction():
        conn.begin()  # SQLAlchemy does not see what the driver cursor runs: without this its commit is a no-op
    # The caller's transaction goes on: its planner settings are put back, in the same round trip.
    results = _rows(conn, [(_CLAIM_PLANNER, {}), (stmts.lock, params), (stmts.take, params),
                           (_CLAIM_PLANNER_UNDO, {})], False)[1:3]
    if any(r[0] is None for r in results[0]):
        return None  # no row to lock: the portable path creates it
    return _claimed(results[1], token)


def finish_and_claim_capped(conn: Connection, stmts: Statements, hot: str, fences: str, limits: Sequence[Any],
                            free: int, worker: str, token: str, lease: float, queues: Sequence[str] | None,
                            alone: bool, plain: bool) -> tuple[set[int], list[Claimed], bool, bool, list[str]]:
    """The worker's finishes, claim of the limited kinds and ordinary claim, in one transaction sent as one
    pipeline on its autocommit connection: BEGIN, the finishes, each kind's lock and take (kind order),
    the ordinary claim for the threads left (if ``plain``), COMMIT.

    Returns (finished ids, claimed, isolated_waiting, ordinary claim short, limits rows missing).
    """
    base = {"worker": worker, "token": token, "lease": float(lease), "queues": list(queues or ()),
            "budget": free, "alone": alone, "skip": [lim.kind for lim in limits]}
    # Only what this turn needs: each statement costs the worker a little (no finishes: no finish statement).
    # The planner settings of the worker's claim (pg_claim.py): the takes walk the pending index too.
    work: list[tuple[str, Any]] = [(_CLAIM_PLANNER, {})]
    if fences:
        work.append((hot, {**base, "fences": fences, "limit": 0}))  # the ordinary statement, claiming none
    for lim in limits:
        work += [(stmts.lock, {**base, "row": lim.row, "kind": lim.kind, "running": lim.running}),
                 (stmts.take, {**base, "row": lim.row, "kind": lim.kind, "running": lim.running})]
    if plain:
        work.append((stmts.rest, {**base, "fences": "", "limit": free}))
    results = _rows(conn, work, True)[1:]
    finished = {r[1] for r in results.pop(0) if r[0] is False} if fences else set()
    missing = [lim.row for lim, rows in zip(limits, results[0:2 * len(limits):2], strict=True)
               if any(r[0] is None for r in rows)]
    jobs: list[Claimed] = []
    waiting = False
    for rows in results[1:2 * len(limits):2]:
        got, left = _claimed(rows, token)
        jobs += got
        waiting = waiting or left
    short = False
    if plain:
        others, left = _claimed(results[-1], token)
        wanted = free - len(jobs)
        short = wanted > 0 and not (jobs and jobs[0].isolated) and len(others) < wanted
        jobs += others
        waiting = waiting or left
    return finished, jobs, waiting, short, missing


def _claimed(rows: list[Any], token: str) -> tuple[list[Claimed], bool]:
    jobs = [Claimed(r[1], r[2], r[3], r[4], r[5], r[6], r[7], token, bool(r[9]), bool(r[10])) for r in rows if r[0]]
    return jobs, any(r[0] is None for r in rows)


def _run(raw: Any, work: list[tuple[str, Any]], own: bool) -> list[list[Any]]:
    """The statements in order, in one pipeline (psycopg 3): one round trip; the server runs them one after
    the other. ``own``: on an autocommit connection, in a transaction of their own (BEGIN … COMMIT)."""
    cursors = [raw.cursor() for _ in work]
    try:
        if not hasattr(raw, "pipeline"):
            for cursor, (stmt, params) in zip(cursors, work, strict=True):
                cursor.execute(stmt, params)
            return [c.fetchall() for c in cursors]
        try:
            with raw.pipeline():
                if own:
                    raw.execute("BEGIN")
                for cursor, (stmt, params) in zip(cursors, work, strict=True):
                    cursor.execute(stmt, params)
                if own:
                    raw.execute("COMMIT")
        except Exception:
            if own and in_transaction(raw):
                raw.execute("ROLLBACK")  # a failed statement left the transaction open: end it
            raise
        return [c.fetchall() if c.description else [] for c in cursors]
    finally:
        for cursor in cursors:
            cursor.close()


async def _run_async(raw: psycopg.AsyncConnection[Any], work: list[tuple[str, Any]],
                     own: bool) -> list[list[Any]]:
    """``_run`` on psycopg's async connection."""
    cursors = [raw.cursor() for _ in work]
    try:
        try:
            async with raw.pipeline():
                if own:
                    await raw.execute("BEGIN")
                for cursor, (stmt, params) in zip(cursors, work, strict=True):
                    await cursor.execute(stmt, params)
                if own:
                    await raw.execute("COMMIT")
        except Exception:
            if own and in_transaction(raw):
                await raw.execute("ROLLBACK")
            raise
        return [await c.fetchall() if c.description else [] for c in cursors]
    finally:
        for cursor in cursors:
            await cursor.close()
