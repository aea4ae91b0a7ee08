"""PostgreSQL: the claim statement run so that it is planned as a walk of the pending index."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from sqlalchemy.util import await_only

if TYPE_CHECKING:
    import psycopg

# psycopg is imported where it is used, not at the top: SQLite and MariaDB processes never load it (0.05 s a start).

__all__ = ["CLAIMED", "Positional", "in_transaction", "is_async", "run_claim"]

# The claim must walk ix_<table>_pending in claim order and stop after `limit` rows. The planner
# takes that plan only when its statistics say the backlog is large, and a queue table's often do
# not (a young table has none; stale ones saw an idle queue): it then reads every pending row
# through a bitmap scan and sorts them all (FOR UPDATE sits between LIMIT and the sort, so no top-N
# sort), and a claim costs O(backlog): 110 ms at 100,000 pending jobs. PostgreSQL has no
# per-statement hints, so the claim's transaction turns off the two plans that read every
# candidate row, with SET LOCAL semantics (set_config(..., true)): nothing outlives the claim's
# transaction, not even behind PgBouncer in transaction mode, where a session setting would reach
# other clients. On the worker's autocommit connection BEGIN, the settings, the claim and COMMIT
# go in one pipeline: still one network round trip. JIT goes off too: a claim touches a few dozen
# rows, but a statement whose estimates run high (the fair claim's lateral LIMITs, sized by an
# expression the planner cannot read) crosses jit_above_cost, and compiling it took 2 s a claim. Sorts go off
# too: every claim's ORDER BY is an index's order, and a sort above an index scan means every candidate row
# read. A claim of named queues (`--queue`, the relay) with a large batch, on a table whose statistics do not
# know its backlog, read all its queue's pending jobs along ix_<table>_fair (led by the queue) and sorted
# them: 23 ms a claim of 1,000 at 40,000 jobs. Where a plan cannot do without a sort (the fair claim's ranks),
# it keeps it.
_SETTINGS = ("enable_bitmapscan", "enable_seqscan", "jit", "enable_sort", "plan_cache_mode")
# Each setting's value is first kept in a placeholder setting of the transaction (sqla_jobs.<name>), so that
# whatever runs after the claim in the same transaction is planned as before it: the caller's own statements when
# the claim runs in the caller's transaction, and the hand-off (handoff.py), which without sorts hashed a fan-out
# root's 100,000 edges to disk and updated its dependents in hash order (1.9 s against 1.2). A SELECT list is
# evaluated in order: each value is kept before it is turned off.
_CLAIM_PLANNER = ("SELECT " + ", ".join(f"set_config('sqla_jobs.{name}', current_setting('{name}'), true)"
                                        for name in _SETTINGS)
                  + ", " + ", ".join(f"set_config('{name}', 'off', true)" for name in _SETTINGS[:-1]))
# A statement whose custom plans cost more to make than to run (the fair claim: 2 ms of planning a claim, 1 ms
# of running) takes its generic plan, made once per connection. PostgreSQL would keep making custom plans for
# it: its generic plan's estimates, sized by LIMITs it cannot read, look dearer than they are.
_GENERIC_PLANNER = _CLAIM_PLANNER + ", set_config('plan_cache_mode', 'force_generic_plan', true)"
#: The settings as they were before ``_CLAIM_PLANNER``, for what runs after the claim in its transaction.
_CLAIM_PLANNER_UNDO = "SELECT " + ", ".join(
    f"set_config('{name}', current_setting('sqla_jobs.{name}'), true)" for name in _SETTINGS)

# The claim's last step, shared by the ordinary claim (postgresql.py) and a limited kind's (pg_limits.py): the
# rows the statement chose in its `due` CTE (its `alone` CTE: an isolated job to run alone) become running
# under the claim's token, and are returned in the column order Driver.finish_and_claim reads.
CLAIMED = """claimed AS (
    UPDATE {live} AS j
    SET state = 'running', attempts = j.attempts + 1, locked_at = now(), locked_by = %(worker)s,
        claim_token = %(token)s, lease_expires_at = now() + make_interval(secs => %(lease)s)
    FROM due WHERE j.id = due.id
        AND (due.id IN (SELECT id FROM alone) OR NOT (due.isolate OR EXISTS (SELECT FROM alone)))
    RETURNING j.id, j.kind, j.queue, j.payload, j.attempts, j.max_attempts, j.priority, j.run_at, j.isolate,
        j.has_dependents
)
SELECT true AS claimed, id, kind, queue, payload, attempts, max_attempts, priority, run_at, isolate, has_dependents
FROM claimed
"""


class Positional:
    """A claim statement written with ``%(name)s`` parameters, sent with PostgreSQL's own ``$n`` ones.

    psycopg turns ``%(name)s`` into ``$n`` on every execute and caches the result only for statements of up to
    4,096 characters; the fair claim (6,000) was parsed anew each claim, a regular-expression split of the whole
    text: a tenth of a millisecond of the worker's CPU per claim. Converted once here, it is sent through
    psycopg's raw cursor, which passes the text as it is.
    """

    def __init__(self, sql: str) -> None:
        self.names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in self.names:
                self.names.append(match.group(1))
            return f"${self.names.index(match.group(1)) + 1}"

        self.sql = re.sub(r"%\((\w+)\)s", number, sql)

    def values(self, params: dict[str, Any]) -> list[Any]:
        """``params`` in the statement's ``$n`` order."""
        return [params[name] for name in self.names]


def is_async(raw: Any) -> bool:
    """Whether ``raw`` is psycopg's ``AsyncConnection`` (the async worker's, or ``queue.aio``'s)."""
    import psycopg

    return isinstance(raw, psycopg.AsyncConnection)


def in_transaction(raw: Any) -> bool:
    """Whether psycopg connection ``raw`` is open and inside a transaction (a failed statement left one open)."""
    from psycopg import pq

    return raw.info.transaction_status != pq.TransactionStatus.IDLE and not raw.closed


def _statement(sql: str | Positional, params: dict[str, Any], asynchronous: bool) -> tuple[str, Any, Any]:
    """The text, the parameters and the cursor class that sends them: the raw cursor for a ``Positional``."""
    import psycopg

    if isinstance(sql, Positional):
        return sql.sql, sql.values(params), psycopg.AsyncRawCursor if asynchronous else psycopg.RawCursor
    return sql, params, psycopg.AsyncCursor if asynchronous else psycopg.Cursor


def run_claim(raw: Any, sql: str | Positional, params: dict[str, Any],
              after: tuple[str, dict[str, Any]] | None = None, generic: bool = False) -> list[Any]:
    """The claim statement's rows, planned with the settings above, on psycopg connection ``raw``; ``after``:
    a statement run next in the same transaction (the hand-off to dependents, handoff.py); ``generic``: the
    statement takes its generic plan once prepared (``_GENERIC_PLANNER``)."""
    planner = _GENERIC_PLANNER if generic else _CLAIM_PLANNER
    if is_async(raw):  # the async worker: we run in its control greenlet, so await
        return await_only(_run_claim_async(raw, sql, params, after, planner))
    from .payloads import faster_payloads

    sql, values, cursor_class = _statement(sql, params, asynchronous=False)
    if raw.autocommit and hasattr(raw, "pipeline"):  # the worker's hot connection (psycopg 3): one round trip
        with raw.cursor() as control, faster_payloads(cursor_class(raw)) as cursor:
            try:
                with raw.pipeline():
                    control.execute("BEGIN")
                    control.execute(planner)
                    cursor.execute(sql, values)
                    if after is not None:
                        control.execute(_CLAIM_PLANNER_UNDO)
                        control.execute(*after)
                    control.execute("COMMIT")
            except Exception:
                if in_transaction(raw):
                    raw.execute("ROLLBACK")  # a failed statement left the transaction open: end it
                raise
            return cursor.fetchall()
    # In the caller's transaction: the settings are put back after.
    with raw.cursor() as cursor, faster_payloads(cursor_class(raw)) as claim:
        cursor.execute(planner)
        claim.execute(sql, values)
        rows = claim.fetchall()
        cursor.execute(_CLAIM_PLANNER_UNDO)
        if after is not None:
            cursor.execute(*after)
        return rows


async def _run_claim_async(raw: psycopg.AsyncConnection[Any], sql: str | Positional, params: dict[str, Any],
                           after: tuple[str, dict[str, Any]] | None, planner: str) -> list[Any]:
    """``run_claim`` on psycopg's async connection: the same statements, the same single round trip."""
    from .payloads import faster_payloads

    sql, values, cursor_class = _statement(sql, params, asynchronous=True)
    if raw.autocommit:
        async with raw.cursor() as control, faster_payloads(cursor_class(raw)) as cursor:
            try:
                async with raw.pipeline():
                    await control.execute("BEGIN")
                    await control.execute(planner)
                    await cursor.execute(sql, values)
                    if after is not None:
                        await control.execute(_CLAIM_PLANNER_UNDO)
                        await control.execute(*after)
                    await control.execute("COMMIT")
            except Exception:
                if in_transaction(raw):
                    await raw.execute("ROLLBACK")
                raise
            return await cursor.fetchall()
    async with raw.cursor() as cursor, faster_payloads(cursor_class(raw)) as claim:
        await cursor.execute(planner)
        await claim.execute(sql, values)
        rows = await claim.fetchall()
        await cursor.execute(_CLAIM_PLANNER_UNDO)
        if after is not None:
            await cursor.execute(*after)
        return rows
