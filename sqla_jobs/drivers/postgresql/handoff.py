"""PostgreSQL: a finished job's dependents counted down in the hot path's own transaction (job graphs).

The worker's hot statement (``_PG_FINISH_AND_CLAIM``) cannot count dependents down
itself: its snapshot is taken when it starts, and a dependent added by a transaction
it then waited for (the flush locks the upstream's row: ``Graph.lock_upstreams``)
is not in it. So the statement finishes only the jobs the worker *knew* had
dependents when it claimed them (``Claimed.has_dependents``), and this statement,
the next one of the same transaction (its own snapshot, in the same pipeline: no
round trip more), counts their dependents down. A job that gained dependents after
its claim is left running by the hot statement and finished by ``Driver.finish``
(``Store.finish_declined``).

``xmin = pg_current_xact_id()`` picks the upstreams this very transaction finished:
a retry of a batch whose commit went through with its reply lost finishes nothing
again, so it counts nothing down twice.

A batch's on_failure callback released with no failed upstream is cancelled here
instead (``drivers/_batches.py``), as ``Graph._released`` has it.
"""

from __future__ import annotations

from sqlalchemy import Table

from .._batches import ERRBACK
from .notify import pg_name

__all__ = ["DECLINE", "TAKE_FLAGGED", "handoff_sql"]

#: The hot statement's test of a job with dependents: left for ``Driver.finish`` ...
DECLINE = " AND NOT j.has_dependents"
#: ... unless the worker names it (it knew at claim time), for the hand-off below.
TAKE_FLAGGED = " AND (NOT j.has_dependents OR j.id = ANY(string_to_array(%(flagged)s, ',')::bigint[]))"

_HANDOFF = """
WITH ups AS (
    SELECT id FROM {table}
    WHERE id = ANY(string_to_array(%(flagged)s, ',')::bigint[]) AND state = 'finished'
        AND xmin = pg_current_xact_id()::xid
), gone AS (
    SELECT downstream_id AS id, count(*) AS n FROM {edges}
    WHERE upstream_id IN (SELECT id FROM ups) AND ended IS NULL
    GROUP BY downstream_id
), counted AS (
    UPDATE {table} AS d
    SET waiting_for = d.waiting_for - gone.n,
        state = CASE WHEN d.waiting_for - gone.n > 0 THEN 'blocked' WHEN {skip} THEN 'cancelled' ELSE 'pending' END,
        run_at = CASE WHEN d.waiting_for - gone.n <= 0 AND d.run_at < now() THEN now() ELSE d.run_at END,
        finished_at = CASE WHEN d.waiting_for - gone.n <= 0 AND {skip} THEN now() ELSE d.finished_at END,
        cancelled_at = CASE WHEN d.waiting_for - gone.n <= 0 AND {skip} THEN now() ELSE d.cancelled_at END,
        last_error = CASE WHEN d.waiting_for - gone.n <= 0 AND {skip} THEN %(skipped)s ELSE d.last_error END
    FROM gone WHERE d.id = gone.id AND d.state = 'blocked'
    RETURNING d.state
)
SELECT pg_notify(%(channel)s, '') FROM (SELECT FROM counted WHERE state = 'pending' LIMIT 1) AS woken
"""


def handoff_sql(jobs: Table, edges: Table) -> str:
    """The count-down of the upstreams named in ``%(flagged)s`` that this transaction finished (and the
    wake-up of listening workers when one became pending). Every SET reads the row's old values, so the count
    and the release are one UPDATE, as in ``Graph._count_down``; here with the upstreams found and the workers
    woken in the same statement."""
    # A CASE, so that the edges are read for an on_failure callback only (``Batches.errback_skip`` says why).
    skip = (f"CASE WHEN d.on_upstream_failure = '{ERRBACK}' THEN NOT EXISTS "
            f"(SELECT FROM {pg_name(edges)} AS x WHERE x.downstream_id = d.id AND x.ended IS NOT NULL) ELSE false END")
    return _HANDOFF.format(table=pg_name(jobs), edges=pg_name(edges), skip=skip)
