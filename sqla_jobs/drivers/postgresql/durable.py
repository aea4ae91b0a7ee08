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

from sqlalchemy import ARRAY, Connection, String, Table, Text, any_, case, cast, func, literal, select, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.elements import ColumnElement

from .._durable import emit_statement

__all__ = ["PgDurable"]


def _strings(values: Collection[str]) -> ColumnElement[Any]:
    return literal(list(values), ARRAY(String))


class PgDurable:
    """``emit_rows`` and ``among`` on arrays (see the module docstring)."""

    emit_chunk: int | None = None  # no bound parameter per event: one round for all

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

    def _waiting(self, keys: Collection[str]) -> ColumnElement[Any]:
        """``ARRAY(...)`` of the jobs with an open wait for one of ``keys``."""
        s = self.steps
        return func.array(select(s.c.job_id).where(self.among(s.c.awaiting, keys), s.c.finished_at.is_(None))
                          .scalar_subquery())

    def wake_waiting(self, conn: Connection, keys: Collection[str]) -> int:
        t = self.jobs
        now = self.now()
        return conn.execute(update(t).where(t.c.id == any_(self._waiting(keys)), t.c.state == "pending")
                            .values(run_at=case((t.c.run_at > now, now), else_=t.c.run_at))).rowcount

    def answer_waiting(self, conn: Connection, keys: Collection[str]) -> None:
        s, t, e = self.steps, self.jobs, self.events
        parked = func.array(select(t.c.id).where(t.c.id == any_(self._waiting(keys)), t.c.state == "pending")
                            .scalar_subquery())
        data = select(e.c.data).where(e.c.key == s.c.awaiting).scalar_subquery()
        conn.execute(update(s).where(s.c.job_id == any_(parked), self.among(s.c.awaiting, keys),
                                     s.c.finished_at.is_(None))
                     .values(value=data, finished_at=self.now()))
