"""Durable jobs' statements on PostgreSQL (mixed into ``PostgreSQLDriver``; the shared ones are in
``drivers/_durable.py``): an emit of any number of events binds their keys and data as two arrays, so
``emit_many`` is the same three statements for one event or 100,000, and its statements' text (and plan)
is the same whatever their number.

The waiting jobs and their waits are found by ``= ANY(ARRAY(subquery))``, the subquery run once, each row then
looked up by its key: with the tables' statistics taken before the jobs parked (autovacuum's ANALYZE lags a
burst), a join of the waits and the pending jobs was planned as a nested loop over both, 50 million row pairs
for 10,000 waiters (6 s a statement, in the caller's transaction).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import ARRAY, BigInteger, Connection, String, Table, Text, and_, any_, cast, func, literal, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from .._durable import emit_statement

__all__ = ["PgDurable"]


def _strings(values: Collection[str]) -> ColumnElement[Any]:
    return literal(list(values), ARRAY(String))


class PgDurable:
    """``emit_rows``, ``among``, ``waiting_jobs`` and ``parked_waits`` on arrays (see the module docstring)."""

    emit_chunk: int | None = None  # no bound parameter per event: one round for all
    id_chunk: int | None = None  # likewise a prune's clean-up: one array of ids

    if TYPE_CHECKING:  # Driver's own
        jobs: Table

        @property
        def events(self) -> Table: ...

        @property
        def steps(self) -> Table: ...

        def now(self) -> ColumnElement[datetime]: ...

    def among(self, column: ColumnElement[str], keys: Collection[str]) -> ColumnElement[bool]:
        if len(keys) == 1:  # emit_event: the statements it always had
            return column == next(iter(keys))
        return column == any_(_strings(keys))

    def among_ids(self, column: ColumnElement[int], ids: Collection[int]) -> ColumnElement[bool]:
        return column == any_(literal(list(ids), ARRAY(BigInteger)))

    def emit_rows(self, conn: Connection, events: dict[str, Any]) -> set[str]:
        """One ``INSERT ... SELECT FROM unnest(keys, data) ON CONFLICT DO UPDATE ... WHERE`` (``emit_statement``); one
        event (``emit_event``) is the ``INSERT ... VALUES`` it always was."""
        now = self.now()
        if len(events) == 1:
            [(key, value)] = events.items()
            row = {"key": key, "data": value, "emitted_at": now, "created_at": now}
            return set(conn.scalars(emit_statement(postgresql.insert(self.events).values(row), self.events)))
        data = cast(literal([json.dumps(value) for value in events.values()], ARRAY(Text)), ARRAY(JSONB))
        given = func.unnest(_strings(events), data).table_valued("key", "data").render_derived()
        rows = select(given.c.key, given.c.data, now, now)
        stmt = postgresql.insert(self.events).from_select(["key", "data", "emitted_at", "created_at"], rows)
        return set(conn.scalars(emit_statement(stmt, self.events)))

    def waiting_jobs(self, keys: Collection[str]) -> ColumnElement[bool]:
        s = self.steps
        waits = select(s.c.job_id).where(self.among(s.c.awaiting, keys), s.c.finished_at.is_(None))
        return self.jobs.c.id == any_(func.array(waits.scalar_subquery()))

    def parked_waits(self, keys: Collection[str]) -> ColumnElement[bool]:
        s, t = self.steps, self.jobs
        parked = select(t.c.id).where(self.waiting_jobs(keys), t.c.state == "pending")
        return and_(s.c.job_id == any_(func.array(parked.scalar_subquery())), self.among(s.c.awaiting, keys),
                    s.c.finished_at.is_(None))
