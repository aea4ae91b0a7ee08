"""PostgreSQL: a fair queue's claim (``sqla_jobs._fair``) as one statement, its cost O(claim size).

``walk`` skip-scans the queue's distinct keys on ``ix_<table>_fair`` (queue, fair_key, priority, run_at,
id) of the pending rows: each step is one index probe for the first key after the previous one, starting
after the claimer's cursor (the last key it served) and wrapping round once, so it reads ``keys`` index
entries however many pending jobs and distinct keys the queue holds (``OFFSET 0`` keeps the planner from
copying each probe into every expression that reads its result: it ran each four times). ``slots`` adds the
keyless turn (jobs with no ``fair_key``) where the ring wraps, and each key's weight. ``picked`` takes each slot's most
urgent due jobs, ``weight * rounds`` of them and up to ``rounds`` more, within the claim's size (``_TOOK``),
``FOR UPDATE SKIP LOCKED`` (a lateral probe of the same index): ``rounds`` is how many rounds of the slots
found fill the claim, so at most ``2 * (limit + sum(weights))`` rows are locked, those not claimed until the
statement's commit. The turns' spare jobs rank after every turn; so a big key beside small ones fills the
claim in its one probe. When slots ran dry before the claim was full all the same, ``extra`` tops it up from
the slots that took all they could, round-robin in ring order again (work-conserving: a lone big key drains
at full speed). ``due`` orders
them round by round, in ring order, and keeps ``limit``; the rest of the claim (isolated jobs, the
UPDATE) is the plain claim's. The claimed rows come back with their key and place in the order, so the
caller moves its cursor to the last key served.

The UPDATE finds its rows by ``id = ANY(ARRAY(...))``, not by a join with ``due``: the lateral LIMITs are
expressions, so the planner guesses ``due`` holds a fraction of the table, and with the table's statistics
(autovacuum's ANALYZE) it then hashed the whole primary key to update 16 rows: 180 ms a claim at 100,000 jobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, Table
from sqlalchemy.exc import DBAPIError

from ..base import Claimed, Fence
from .claim import Positional, run_claim
from .notify import pg_name
from .partitions import is_partitioned, live_name

__all__ = ["FAIR_CLAIM", "SKIP_FILTERS", "PgFair", "fair_claim_sql"]

#: The plain claim's filters, by its variant's bits: 1 leaves out the limited kinds (drivers/_limits.py), 2 the
#: fair queues (claimed here); neither: the plain statement as it always was.
_KINDS, _QUEUES = " AND kind <> ALL(%(skip)s::text[])", " AND queue <> ALL(%(skip_queues)s::text[])"
SKIP_FILTERS = ("", _KINDS, _QUEUES, _KINDS + _QUEUES)

#: The hot statements' finish of the last batch (``done``): by UPDATE, or by DELETE for a worker that keeps no
#: finished jobs (``Driver.discarding_finished``); shared with driver.py's ``_PG_FINISH_AND_CLAIM``.
FINISH = {
    False: "UPDATE {table} AS j SET state = 'finished', finished_at = now(), lease_expires_at = NULL\n    FROM",
    True: "DELETE FROM {table} AS j USING",
}
# A job with dependents is left to Driver.finish (Store.finish_declined), as the plain hot statement leaves it.
_DONE = """done AS (
    {finish} (
        SELECT split_part(pair, ':', 1)::bigint AS id, split_part(pair, ':', 2) AS token
        FROM unnest(string_to_array(%(fences)s, ',')) AS pair
    ) AS f
    WHERE j.id = f.id AND j.claim_token = f.token AND j.state = 'running' AND NOT j.has_dependents
    RETURNING j.id
), """
_PENDING = "state = 'pending' AND queue = %(queue)s"
_NEXT = f"(SELECT fair_key FROM {{live}} WHERE {_PENDING} AND fair_key > {{after}} ORDER BY fair_key LIMIT 1)"
# Where the ring wraps: the lowest key below the cursor, else the cursor's own key, unread. Not the lowest key of
# all: a big key served last (the cursor) has its claimed jobs' index entries first in its range until VACUUM, and
# finding its first pending one walked them all, at every claim (its turn's take walks them once more anyway).
_WRAP = (f"COALESCE((SELECT fair_key FROM {{live}} WHERE {_PENDING} AND fair_key < %(after)s ORDER BY fair_key "
         "LIMIT 1), NULLIF(%(after)s, ''))")
_TAKE = f"""SELECT id, isolate, priority, run_at,
            row_number() OVER (ORDER BY priority DESC, run_at, id) - 1 AS rn
        FROM (SELECT id, isolate, priority, run_at FROM {{live}}
            WHERE {_PENDING} AND run_at <= now() AND {{match}} AND kind <> ALL(%(skip)s::text[]){{besides}}
            ORDER BY queue, fair_key, priority DESC, run_at, id LIMIT {{take}} FOR UPDATE SKIP LOCKED) AS x"""
# ORDER BY queue, fair_key first (both fixed by the WHERE, so the order is the same): the order of ix_<table>_fair
# alone, so the planner never walks ix_<table>_pending instead, filtering every other key's jobs (it did for the
# keyless turn: O(backlog) a claim). A key is matched as the range [k, k], not by `=`: the planner drops a column
# equal to a value from the ORDER BY, and then ix_<table>_pending's order served too; with the table's statistics
# it walked that index past a big tenant's jobs for each small key's turn (50 ms a key, 0.5 s a claim).

# A turn's jobs and as many again, up to the claim's size, at most a round's worth more: one big key beside a
# few small ones fills the claim in this one probe (it was `+ 1`, the rest a second probe of that key, `extra`),
# and all the turns together lock at most twice the claim and its weights.
_TOOK = "s.w * rounds.r + greatest(0, least(rounds.r, %(limit)s - s.w * rounds.r))"

FAIR_CLAIM = """
WITH RECURSIVE {done}walk(k, lap, pos) AS (
    SELECT s.k, s.lap, 1 FROM (
        SELECT COALESCE(n.k, n.low) AS k, CASE WHEN n.k IS NULL THEN 1 ELSE 0 END AS lap FROM (
            SELECT x.k, CASE WHEN x.k IS NULL THEN {wrap} END AS low FROM (SELECT {first} AS k OFFSET 0) AS x
            OFFSET 0) AS n
        OFFSET 0) AS s
    WHERE s.k IS NOT NULL AND (s.lap = 0 OR s.k <= %(after)s)
    UNION ALL
    SELECT s.k, s.lap, w.pos + 1 FROM walk AS w CROSS JOIN LATERAL (
        SELECT COALESCE(n.k, n.low) AS k, CASE WHEN n.k IS NULL THEN 1 ELSE w.lap END AS lap FROM (
            SELECT x.k, CASE WHEN w.lap = 0 AND x.k IS NULL THEN {wrap} END AS low
            FROM (SELECT {step} AS k OFFSET 0) AS x OFFSET 0) AS n
        OFFSET 0) AS s
    WHERE w.pos < %(keys)s AND s.k IS NOT NULL AND (s.lap = 0 OR s.k <= %(after)s)
), slots AS MATERIALIZED (
    SELECT walk.k, walk.lap * 2 AS ring, COALESCE(wt.w, 1) AS w
    FROM walk LEFT JOIN unnest(%(wkeys)s::text[], %(wvals)s::int[]) AS wt(k, w) ON wt.k = walk.k
    UNION ALL  -- the keyless turn, when the queue has keyless jobs (else it would thin out every key's share)
    SELECT NULL, 1, 1 WHERE EXISTS (SELECT FROM {live} WHERE {pending} AND fair_key IS NULL)
), rounds AS (
    SELECT ceil(%(limit)s::numeric / sum(w))::int AS r FROM slots
), picked AS MATERIALIZED (
    SELECT j.*, s.k, s.ring, s.w, s.w * rounds.r AS cap, {took} AS took
    FROM slots AS s CROSS JOIN rounds CROSS JOIN LATERAL ({take_keyed}) AS j WHERE s.k IS NOT NULL
    UNION ALL
    SELECT j.*, s.k, s.ring, s.w, s.w * rounds.r, {took}
    FROM slots AS s CROSS JOIN rounds CROSS JOIN LATERAL ({take_keyless}) AS j WHERE s.k IS NULL
), full_slots AS (
    SELECT k, ring, %(limit)s - (SELECT count(*) FROM picked) AS n FROM picked
    GROUP BY k, ring HAVING count(*) >= max(took)
), extra AS MATERIALIZED (
    SELECT j.*, t.k, t.ring, 1 AS w, 0 AS cap, 0 AS took FROM full_slots AS t CROSS JOIN LATERAL (
        {extra_keyed}) AS j WHERE t.k IS NOT NULL AND t.n > 0
    UNION ALL
    SELECT j.*, t.k, t.ring, 1, 0, 0 FROM full_slots AS t CROSS JOIN LATERAL (
        {extra_keyless}) AS j WHERE t.k IS NULL AND t.n > 0
), due AS MATERIALIZED (
    SELECT id, isolate, ord FROM (
        SELECT id, isolate, row_number() OVER (ORDER BY CASE WHEN cap = 0 THEN 1000000 + rn ELSE rn / w END,
                                                    ring, k, rn) AS ord
        FROM (SELECT * FROM picked UNION ALL SELECT * FROM extra) AS a
    ) AS b WHERE ord <= %(limit)s
), alone AS (
    SELECT id FROM due WHERE isolate AND %(alone)s ORDER BY ord LIMIT 1
), claimed AS (
    UPDATE {live} AS j
    SET state = 'running', attempts = j.attempts + 1, locked_at = now(), locked_by = %(worker)s,
        claim_token = %(token)s, lease_expires_at = now() + make_interval(secs => %(lease)s)
    WHERE j.id = ANY(ARRAY(SELECT id FROM due
        WHERE id IN (SELECT id FROM alone) OR NOT (isolate OR EXISTS (SELECT FROM alone))))
    RETURNING j.id, j.kind, j.queue, j.payload, j.attempts, j.max_attempts, j.priority, j.run_at, j.isolate,
        j.has_dependents, j.fair_key
)
SELECT true AS claimed, c.id, kind, queue, payload, attempts, max_attempts, priority, run_at, c.isolate,
    has_dependents, fair_key, due.ord
FROM claimed AS c JOIN due ON due.id = c.id
UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM due
WHERE isolate AND id NOT IN (SELECT id FROM alone)
UNION ALL
SELECT false, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM done
"""


def fair_claim_sql(live: str, finish: str) -> str:
    """``FAIR_CLAIM`` for the table (or live partition) ``live``, finishing the last batch in ``table``'s way."""
    def take(match: str, count: str, besides: str = "") -> str:
        return _TAKE.format(live=live, match=match, take=count, besides=besides)

    others = " AND id <> ALL(ARRAY(SELECT id FROM picked))"
    return FAIR_CLAIM.format(
        live=live,
        pending=_PENDING,
        done=_DONE.format(finish=finish),
        first=_NEXT.format(live=live, after="%(after)s"),
        step=_NEXT.format(live=live, after="w.k"),
        wrap=_WRAP.format(live=live),
        take_keyed=take("fair_key >= s.k AND fair_key <= s.k", _TOOK),
        take_keyless=take("fair_key IS NULL", _TOOK),
        took=_TOOK,
        extra_keyed=take("fair_key >= t.k AND fair_key <= t.k", "greatest(t.n, 0)", others),
        extra_keyless=take("fair_key IS NULL", "greatest(t.n, 0)", others),
    )


class PgFair:
    """The PostgreSQL driver's fair claim (mixed into ``PostgreSQLDriver``)."""

    jobs: Table

    def claim_fair(self, conn: Connection, queue: str, weights: Mapping[str, int], after: str, limit: int,
                   worker: str, token: str, lease: float, alone: bool,
                   skip_kinds: Sequence[str] = ()) -> tuple[list[Claimed], bool, str]:
        """See ``Driver.claim_fair``: one statement, on the worker's connection one round trip (``run_claim``)."""
        _, jobs, waiting, cursor = self.finish_and_claim_fair(conn, [], queue, weights, after, limit, worker, token,
                                                              lease, alone, skip_kinds)
        return jobs, waiting, cursor

    def finish_and_claim_fair(self, conn: Connection, fences: Sequence[Fence], queue: str,
                              weights: Mapping[str, int], after: str, limit: int, worker: str, token: str,
                              lease: float, alone: bool,
                              skip_kinds: Sequence[str] = ()) -> tuple[set[int], list[Claimed], bool, str]:
        """See ``Driver.finish_and_claim_fair``: the finish is the statement's ``done``."""
        live = live_name(self.jobs) if is_partitioned(conn, self.jobs) else pg_name(self.jobs)
        cache = self.__dict__.setdefault("_fair_sql", {})
        key = (live, self.discard_finished)
        if key not in cache:
            finish = FINISH[self.discard_finished].format(table=pg_name(self.jobs))
            cache[key] = Positional(fair_claim_sql(live, finish))
        sql = cache[key]
        params = {"fences": ",".join(f"{job_id}:{job_token}" for job_id, job_token in fences), "queue": queue,
                  "after": after, "limit": max(limit, 0), "keys": max(limit, 1), "wkeys": list(weights),
                  "wvals": list(weights.values()), "skip": list(skip_kinds), "worker": worker, "token": token,
                  "lease": float(lease), "alone": alone}
        if not conn.in_transaction():
            conn.begin()  # SQLAlchemy must know of the transaction the driver's cursor runs in (see driver.py)
        try:
            rows = run_claim(conn.connection.driver_connection, sql, params, generic=True)
        except Exception as exc:
            if isinstance(exc, conn.dialect.loaded_dbapi.Error):
                raise DBAPIError.instance(sql.sql, params, exc, conn.dialect.loaded_dbapi.Error) from exc
            raise
        finished = {r[1] for r in rows if r[0] is False}
        claimed = sorted((r for r in rows if r[0]), key=lambda r: r[12])
        waiting = any(r[0] is None for r in rows)
        jobs = [Claimed(r[1], r[2], r[3], r[4], r[5], r[6], r[7], token, bool(r[9]), bool(r[10])) for r in claimed]
        return finished, jobs, waiting, (claimed[-1][11] or "") if claimed else after
