"""Unique keys: insert a job unless its key is held, and find the holder (mixed into ``Driver``).

The unique index on the generated column ``unique_held`` decides (see
``sqla_jobs._unique``); nothing here reads before it writes. Two ways to let
the index refuse a duplicate without aborting the caller's transaction:

* ``ON CONFLICT (unique_held) WHERE unique_held IS NOT NULL DO NOTHING``
  (PostgreSQL, SQLite: ``on_conflict_insert``), which waits for a concurrent
  insert of the same key to commit or roll back and then inserts or not;
* a savepoint around a plain INSERT, rolled back on the duplicate-key error
  (the default: MariaDB/MySQL, which has no conflict target for one index).

A duplicate that asks to replace or debounce (``on_duplicate``) then updates
the holder with one ``UPDATE … WHERE unique_held = :key AND state = 'pending'``
(``update_holder``): the row lock it takes orders it after a worker's claim of
the same row and after other enqueuers' updates, and the ``WHERE`` is checked
again on the row as they left it, so a holder that started running is never
changed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import Connection, Table, Text, case, insert, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

__all__ = ["Uniqueness", "on_conflict_insert"]

_COLUMNS = ("kind", "queue", "priority", "max_attempts", "unique_key", "unique_states")


class Uniqueness:
    """Unique-key statements; the defaults use a savepoint, a backend with ``ON CONFLICT`` overrides."""

    jobs: Table
    dead: Table

    def key_or_periods(self, key: str) -> ColumnElement[bool]:
        """Jobs whose ``unique_key`` is ``key`` or one of its periods (``key@<period start>``): the filters'."""
        t = self.jobs
        return or_(t.c.unique_key == key, t.c.unique_key.startswith(f"{key}@", autoescape=True))

    def payload_value(self, text: str) -> ColumnElement[Any]:
        """The payload's JSON text as a value for an INSERT into the payload column."""
        return literal(text, Text())

    def unique_values(self, row: dict[str, Any]) -> dict[str, Any]:
        """A checked row (``_fields.check_row``) as INSERT values; no ``run_at``: the database clock."""
        values = {c: row[c] for c in _COLUMNS}
        values["payload"] = self.payload_value(row["payload"])
        if row.get("run_at") is not None:
            values["run_at"] = row["run_at"]
        if row.get("trace_context") is not None:  # JSON text, as the payload (sqla_jobs.otel)
            values["trace_context"] = self.payload_value(row["trace_context"])
        if row.get("fair_key") is not None:  # its turn in a fair queue (sqla_jobs._fair)
            values["fair_key"] = row["fair_key"]
        return values

    def is_duplicate_key(self, exc: IntegrityError) -> bool:
        """Whether ``exc`` is the unique-key index refusing a second holder (not some other constraint)."""
        message = str(exc.orig)
        return f"ux_{self.jobs.name}_unique" in message or "unique_held" in message

    def insert_unique(self, conn: Connection, row: dict[str, Any]) -> int | None:
        """Insert ``row`` in the caller's transaction; its id, or None when another job holds its key."""
        stmt = insert(self.jobs).values(**self.unique_values(row))
        savepoint = conn.begin_nested()
        try:
            result = conn.execute(stmt)
        except IntegrityError as exc:
            savepoint.rollback()  # only the INSERT is undone: the caller's transaction goes on
            if self.is_duplicate_key(exc):
                return None
            raise
        savepoint.commit()
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    #: ``with_for_update`` options for reading the holder of a key (None: a plain read sees it).
    holder_lock: ClassVar[dict[str, Any] | None] = None

    def unique_holder(self, conn: Connection, key: str) -> int | None:
        """The id of the job holding ``key`` now (through the unique index), or None."""
        t = self.jobs
        stmt = select(t.c.id).where(t.c.unique_held == key)
        if self.holder_lock is not None:
            stmt = stmt.with_for_update(**self.holder_lock)
        return conn.execute(stmt).scalar()

    def update_holder(self, conn: Connection, key: str, payload: str, run_at: datetime | None,
                      trace_context: str | None = None) -> bool:
        """Give the pending job holding ``key`` this ``payload`` (JSON text) and, with ``run_at``, push its
        ``run_at`` out to it (never earlier); False when no pending job holds the key (it runs, or ended).
        A ``trace_context`` (JSON text) replaces the holder's: its run joins the trace of the latest enqueue."""
        t = self.jobs
        values: dict[str, Any] = {"payload": self.payload_value(payload)}
        if trace_context is not None:
            values["trace_context"] = self.payload_value(trace_context)
        if run_at is not None:
            later = literal(run_at, t.c.run_at.type)
            values["run_at"] = case((t.c.run_at < later, later), else_=t.c.run_at)
        stmt = update(t).where(t.c.unique_held == key, t.c.state == "pending").values(**values)
        return conn.execute(stmt).rowcount == 1

    def dead_has_key(self, conn: Connection, key: str) -> bool:
        """Whether a dead job carries ``key`` (a periodic slot whose job used up its attempts)."""
        d = self.dead
        return conn.execute(select(d.c.id).where(d.c.unique_key == key).limit(1)).first() is not None


def on_conflict_insert(driver: Uniqueness, conn: Connection, row: dict[str, Any],
                       dialect_insert: Callable[[Table], Any]) -> int | None:
    """``INSERT … ON CONFLICT (unique_held) WHERE unique_held IS NOT NULL DO NOTHING RETURNING id``."""
    t = driver.jobs
    stmt = (
        dialect_insert(t)
        .values(**driver.unique_values(row))
        .on_conflict_do_nothing(index_elements=[t.c.unique_held], index_where=t.c.unique_held.is_not(None))
        .returning(t.c.id)
    )
    return conn.execute(stmt).scalar()
