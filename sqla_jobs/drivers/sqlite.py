"""The SQLite driver (the standard library's sqlite3).

================  ===========================================================
claim             ``UPDATE … WHERE id IN (…)`` under ``BEGIN IMMEDIATE``: the
                  database-wide write lock makes it atomic, no row locks
now / later       ``strftime('%f', 'now', '+N seconds')`` in SQLAlchemy's text
                  format, so comparisons as strings are right
append an error   ``json_insert(errors, '$[#]', …)``
wake-up           none: workers poll
percentiles       computed in Python from one row per run
================  ===========================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Integer,
    String,
    Table,
    cast,
    func,
    select,
    text,
    type_coerce,
    update,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeEngine
from sqlalchemy.util import await_only
from sqlalchemy.util.concurrency import in_greenlet

from ._durable import emit_statement, upsert_statement
from ._unique import on_conflict_insert
from .base import Claimed, Driver, IndexDefinition, run_times_in_python

__all__ = ["SQLiteDriver"]

log = logging.getLogger("sqla_jobs")

#: How long a worker keeps trying to switch a busy database to WAL before it goes on without (seconds).
WAL_SWITCH_WAIT = 30.0


def _pause(seconds: float) -> None:
    """Wait between tries; in the async worker's greenlet, on its event loop, so the app's own
    coroutines (the writer we wait for, if it shares the loop) go on meanwhile."""
    if in_greenlet():
        await_only(asyncio.sleep(seconds))
    else:
        time.sleep(seconds)


def _master(schema: str | None) -> str:
    """SQLite's catalogue table of the main or an attached database."""
    return f'"{schema}".sqlite_master' if schema else "sqlite_master"


def _parse_create_index(sql: str) -> IndexDefinition | None:
    """Parse SQLite's own copy of ``CREATE INDEX``: reflection drops DESC (and, in some versions, more)."""
    head = re.match(r"\s*create\s+(unique\s+)?index\s.*?\son\s+[^(]+\(", sql, re.IGNORECASE | re.DOTALL)
    if head is None:
        return None
    depth, start = 1, head.end()
    for i in range(start, len(sql)):
        depth += {"(": 1, ")": -1}.get(sql[i], 0)
        if depth == 0:
            break
    else:
        return None
    elements = tuple(e.strip() for e in sql[start:i].split(","))  # no commas inside our index elements
    rest = re.match(r"\s*where\s+(.*?)\s*$", sql[i + 1 :], re.IGNORECASE | re.DOTALL)
    return bool(head.group(1)), elements, rest.group(1) if rest else None


class SQLiteDriver(Driver):
    """SQLite: see the module docstring."""

    name = "sqlite"
    label = "SQLite"
    async_drivers = (("sqlite", "sqlite+aiosqlite"), ("sqlite+pysqlite", "sqlite+aiosqlite"))
    partial_indexes = True
    self_fencing = False

    # -- class level ---------------------------------------------------------------

    @classmethod
    def column_type(cls, role: str) -> TypeEngine[Any] | None:
        # Only INTEGER PRIMARY KEY is the rowid alias (BIGINT would be a column of its own, never filled in).
        return Integer() if role == "id" else None

    @classmethod
    def table_options(cls, table: str) -> dict[str, Any]:
        # AUTOINCREMENT: a job id is never reused, not even after the newest jobs were deleted.
        return {"sqlite_autoincrement": True} if table == "jobs" else {}

    @classmethod
    def json_field_text(cls, document: ColumnElement[Any], field: str) -> ColumnElement[str]:
        return cast(func.json_extract(document, f'$."{field}"'), String())

    @classmethod
    def missing_database(cls, url: URL) -> str | None:
        database = url.database
        if not database or database == ":memory:" or database.startswith("file:") or url.query.get("uri"):
            return None  # in memory, or a URI filename whose mode decides: nothing to check
        path = os.path.abspath(database)
        return None if os.path.exists(path) else path

    @classmethod
    def index_sql(cls, conn: Connection, schema: str | None, table: str) -> dict[str, str | None]:
        """Name and ``CREATE INDEX`` text of each index of ``table`` (None: an automatic index)."""
        query = text(f"SELECT name, sql FROM {_master(schema)} WHERE type = 'index' AND tbl_name = :t")
        return {r[0]: r[1] for r in conn.execute(query, {"t": table})}

    @classmethod
    def reflect_indexes(cls, conn: Connection, schema: str | None, table: str) -> dict[str, IndexDefinition | None]:
        return {name: _parse_create_index(sql) for name, sql in cls.index_sql(conn, schema, table).items() if sql}

    @classmethod
    def check_reflected_table(cls, conn: Connection, schema: str | None, table: Table) -> None:
        """alembic's batch mode rebuilds a table without AUTOINCREMENT; it has no operation to restore it."""
        if not table.dialect_options["sqlite"].get("autoincrement"):
            return
        query = text(f"SELECT sql FROM {_master(schema)} WHERE type = 'table' AND name = :t")
        created = conn.execute(query, {"t": table.name}).scalar() or ""
        if "autoincrement" not in created.lower():
            log.warning(
                "table %s was created without AUTOINCREMENT (alembic's batch mode drops it when it rebuilds a "
                "table): SQLite may reuse the id of a job that left the table, so requeueing its dead-letter copy "
                "can fail; rebuild it with op.batch_alter_table(%r, recreate='always', "
                "table_kwargs={'sqlite_autoincrement': True})",
                table.name,
                table.name,
            )

    @classmethod
    @contextmanager
    def bench_scratch(cls, url: URL) -> Iterator[URL]:
        base = url.database if url.database not in (None, "", ":memory:") else None
        folder = os.path.dirname(os.path.abspath(base)) if base else tempfile.gettempdir()
        path = os.path.join(folder, f"sqla-jobs-bench-{os.getpid()}.db")
        _remove_abandoned(folder)
        try:
            yield url.set(database=path)
        finally:
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.remove(path + suffix)

    def bench_table_stats(self, conn: Connection) -> dict[str, float]:
        # dbstat is compiled into most builds; without it the soak plots no sizes.
        names = [row[0] for row in conn.execute(
            text("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = :t"), {"t": self.jobs.name})]
        try:
            sizes = dict(conn.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")).all())
        except DBAPIError:
            return {}
        return {"table_bytes": float(sizes.get(self.jobs.name, 0)),
                "index_bytes": float(sum(sizes.get(name, 0) for name in names))}

    # -- time and transactions -------------------------------------------------------

    def now(self) -> ColumnElement[datetime]:
        # Same text format SQLAlchemy writes, so comparisons as strings are right.
        return type_coerce(func.strftime("%Y-%m-%d %H:%M:%f000", "now"), DateTime(timezone=True))

    def later(self, seconds: float) -> ColumnElement[datetime]:
        return type_coerce(
            func.strftime("%Y-%m-%d %H:%M:%f000", "now", f"{seconds:+.6f} seconds"),
            DateTime(timezone=True),
        )

    def seconds_between(self, later: Any, earlier: Any) -> ColumnElement[float]:
        return (func.julianday(later) - func.julianday(earlier)) * 86400.0

    def begin_write(self, conn: Connection) -> None:
        """Take the write lock now, waiting up to 30 s for it.

        A deferred SQLite transaction that reads and then writes can fail with
        SQLITE_BUSY when another process wrote in between; BEGIN IMMEDIATE
        waits (busy_timeout) for the lock instead, so the claim is atomic.
        """
        conn.exec_driver_sql("PRAGMA busy_timeout = 30000")
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    def is_conflict(self, exc: BaseException) -> bool:
        """SQLITE_BUSY ("database is locked"): another connection held the lock for longer than we waited."""
        orig = getattr(exc, "orig", None)
        return isinstance(exc, DBAPIError) and getattr(orig, "sqlite_errorcode", None) in {5, 6}  # BUSY, LOCKED

    def prepare(self, engine: Engine) -> None:
        """WAL lets SQLite readers and one writer work side by side.

        The switch needs the database to itself, and while another connection
        writes SQLite refuses it at once ("database is locked") instead of
        waiting out the busy timeout. A worker started beside a busy app (a
        thread in a web process) tries again for up to ``WAL_SWITCH_WAIT``
        seconds; if the app writes all that time, the worker carries on in the
        current journal mode, which is slower for readers but just as correct,
        and says so.
        """
        if engine.url.database in (None, "", ":memory:"):
            return
        deadline = time.monotonic() + WAL_SWITCH_WAIT
        with engine.connect() as conn:
            while True:
                try:
                    mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
                    if str(mode).lower() != "wal":
                        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
                    conn.commit()
                    return
                except DBAPIError as exc:
                    conn.rollback()
                    if not self.is_conflict(exc):
                        raise
                    if time.monotonic() > deadline:
                        log.warning("SQLite database %s stayed busy for %gs, so it is not in WAL mode; "
                                    "the worker goes on without it (readers wait for writers)",
                                    engine.url.database, WAL_SWITCH_WAIT)
                        return
                    _pause(0.05)

    def index_names(self, conn: Connection) -> set[str]:
        # Some SQLAlchemy versions leave SQLite expression indexes (the claim index) out of reflection.
        return set(self.index_sql(conn, self.jobs.schema, self.jobs.name))

    # -- the worker's path -----------------------------------------------------------

    def claim_batch(
        self,
        conn: Connection,
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        alone: bool,
        skip_kinds: Sequence[str] = (),
    ) -> tuple[list[Claimed], bool]:
        """Under BEGIN IMMEDIATE: choose among the due window, then take the rows."""
        if limit <= 0:
            return [], False
        t = self.jobs
        due = select(t.c.id, t.c.isolate).where(t.c.state == "pending", t.c.run_at <= self.now())
        if queues:
            due = due.where(t.c.queue.in_(queues))
        if skip_kinds:
            due = due.where(t.c.kind.not_in(list(skip_kinds)))
        if self.skip_queues:  # fair queues, claimed by drivers/_fair.py
            due = due.where(t.c.queue.not_in(self.skip_queues))
        window = list(conn.execute(due.order_by(t.c.priority.desc(), t.c.run_at, t.c.id).limit(limit)))
        isolated = [r.id for r in window if r.isolate]
        if alone and isolated:
            ids, waiting = isolated[:1], len(isolated) > 1  # the window is in claim order: the most urgent one
        else:
            ids, waiting = [r.id for r in window if not r.isolate], bool(isolated)
        if not ids:
            return [], waiting
        stmt = update(t).values(
            state="running",
            attempts=t.c.attempts + 1,
            locked_at=self.now(),
            locked_by=worker,
            claim_token=token,
            lease_expires_at=self.later(lease),
        )
        # Under BEGIN IMMEDIATE nobody else writes meanwhile: the window read above needs no row locks.
        stmt = stmt.where(t.c.id.in_(ids)).returning(
            t.c.id, t.c.kind, t.c.queue, t.c.payload, t.c.attempts, t.c.max_attempts, t.c.priority, t.c.run_at,
            t.c.isolate,
        )
        # UPDATE … RETURNING has no order: give the batch back in claim order.
        rows = sorted(conn.execute(stmt), key=lambda r: (-r.priority, r.run_at, r.id))
        claimed = [Claimed(r.id, r.kind, r.queue, r.payload, r.attempts, r.max_attempts, r.priority, token,
                           bool(r.isolate)) for r in rows]
        return claimed, waiting

    def insert_unique(self, conn: Connection, row: dict[str, Any]) -> int | None:
        # Writers take turns on SQLite, so the conflict is always with a committed holder.
        return on_conflict_insert(self, conn, row, sqlite.insert)

    def upsert(self, conn: Connection, table: Table, row: dict[str, Any] | list[dict[str, Any]],
               update: Sequence[str] = ()) -> None:
        conn.execute(upsert_statement(sqlite.insert(table).values(row), table, update))

    def emit_rows(self, conn: Connection, events: dict[str, Any]) -> set[str]:
        now = self.now()
        rows = [{"key": key, "data": data, "emitted_at": now, "created_at": now} for key, data in events.items()]
        return set(conn.scalars(emit_statement(sqlite.insert(self.events).values(rows), self.events)))

    def errors_plus(self, entry: dict[str, Any]) -> ColumnElement[Any]:
        return text("json_insert(COALESCE(errors, '[]'), '$[#]', json(:entry))").bindparams(entry=json.dumps(entry))

    def run_times(self, conn: Connection, window: float) -> list[tuple[str, int, float, float, float, float]]:
        """No percentile function in SQLite: one row per run, the figures computed here."""
        t = self.jobs
        took = self.seconds_between(t.c.finished_at, t.c.locked_at)
        return run_times_in_python(conn.execute(select(t.c.kind, took).where(self.recently_finished(window))))


def _remove_abandoned(folder: str) -> None:
    """Remove the scratch files of benches no longer running on this machine (one killed with SIGKILL
    leaves its own): their names end in the process id."""
    for name in os.listdir(folder):
        found = re.fullmatch(r"sqla-jobs-bench-(\d+)\.db(-wal|-shm)?", name)
        if found is None or _running(int(found.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):  # another bench starting removed it first
            os.remove(os.path.join(folder, name))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
