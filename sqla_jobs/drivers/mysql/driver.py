"""The MariaDB / MySQL driver (PyMySQL, the ``sqla-jobs[mysql]`` extra).

================  ===========================================================
claim             ``SELECT … FOR UPDATE SKIP LOCKED`` then ``UPDATE … WHERE id
                  IN (…)``, in one short READ COMMITTED transaction
now / later       ``UTC_TIMESTAMP(6)``, ``TIMESTAMPADD(MICROSECOND, …)``:
                  ``DATETIME(6)`` columns hold UTC with microseconds
append an error   ``JSON_ARRAY_APPEND(errors, '$', JSON_EXTRACT(:entry, '$'))``
RETURNING         none used: MySQL has none and MariaDB none on UPDATE, so each
                  fenced write locks its rows (``FOR UPDATE``), then changes them
wake-up           none: workers poll (``--poll-interval``)
percentiles       computed in Python from one row per run
indexes           no partial indexes: ``state`` leads the claim and reaper
                  indexes (see ``JobMixin.job_indexes``)
================  ===========================================================

Isolation: every write transaction runs at READ COMMITTED (``begin_write``).
InnoDB's default, REPEATABLE READ, takes *gap* locks on the index ranges a
locking read scans: a claimer's ``FOR UPDATE`` would then block enqueuers
inserting into that range and can deadlock with them and with other claimers.
At READ COMMITTED a locking read locks only the rows it returns (rows it
examined and rejected are unlocked at once), which is what a ``SKIP LOCKED``
queue needs: claimers skip each other's rows and never wait on gaps. Every
statement here is written within what both MariaDB ≥ 10.6 and MySQL ≥ 8.0
accept (no RETURNING, no ``CAST … AS JSON``, no partial indexes).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    Connection,
    Float,
    Integer,
    Select,
    Table,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal_column,
    select,
    text,
    tuple_,
    type_coerce,
    union_all,
    update,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.elements import ColumnElement

from .._operations import requeued_errors, truncate, utcnow
from ..base import DEAD_COLUMNS, Claimed, Driver, Fence, run_times_in_python
from .bench import MySQLBench
from .schema import DATETIME6, MySQLSchema
from .stats import MySQLStats

__all__ = ["MySQLDriver"]

# A lost connection or server (PyMySQL's args[0]): 2006 gone away, 2013 lost during query, 2003 can't
# connect, 2055 lost at handshake, 1927 killed (MariaDB), 4031 idle cut (MySQL), 1053 server shutdown.
_GONE = {2006, 2013, 2003, 2055, 1927, 4031, 1053}


def _error_code(exc: BaseException) -> object:
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    return orig.args[0] if orig is not None and orig.args else None


class MySQLDriver(MySQLSchema, MySQLStats, MySQLBench, Driver):
    """MariaDB and MySQL: see the module docstring."""

    name = "mariadb"
    label = "MariaDB/MySQL"
    url_aliases = ("mysql",)
    async_drivers = (("mysql+pymysql", "mysql+aiomysql"), ("mariadb+pymysql", "mariadb+aiomysql"))

    # -- class level ---------------------------------------------------------------

    @classmethod
    def normalise_url(cls, url: URL) -> URL:
        if url.drivername in ("mysql", "mariadb"):
            url = url.set(drivername=f"{url.drivername}+pymysql")  # PyMySQL is the extra we ship
        if "charset" not in url.query:
            url = url.update_query_dict({"charset": "utf8mb4"})  # 4-byte UTF-8: emoji in payloads
        return url

    def is_disconnect(self, exc: BaseException) -> bool:
        return isinstance(exc, DBAPIError) and (exc.connection_invalidated or _error_code(exc) in _GONE)

    @classmethod
    def is_read_only(cls, exc: BaseException) -> bool:
        # running with --read-only / super_read_only; a read-only transaction; innodb_read_only
        return _error_code(exc) in {1290, 1792, 1836}

    def is_conflict(self, exc: BaseException) -> bool:
        return _error_code(exc) in {1213, 1205}  # deadlock found; lock wait timeout (InnoDB rolls back)

    # -- time ------------------------------------------------------------------------

    def now(self) -> ColumnElement[datetime]:
        return type_coerce(func.utc_timestamp(literal_column("6")), DATETIME6)

    def later(self, seconds: float) -> ColumnElement[datetime]:
        # An anonymous bind: one statement may hold several offsets (lease and delay, say).
        micros = bindparam(None, round(seconds * 1_000_000), Integer())
        return type_coerce(
            func.timestampadd(literal_column("MICROSECOND"), micros, func.utc_timestamp(literal_column("6"))),
            DATETIME6,
        )

    def seconds_between(self, later: Any, earlier: Any) -> ColumnElement[float]:
        micros = func.timestampdiff(literal_column("MICROSECOND"), earlier, later)
        return type_coerce(micros / literal_column("1000000.0"), Float())

    def server_uptime(self, conn: Connection) -> float | None:
        row = conn.execute(text("SHOW GLOBAL STATUS LIKE 'Uptime'")).first()  # MariaDB and MySQL alike
        return float(row[1]) if row is not None else None

    # -- transactions and schema -------------------------------------------------------

    @property
    def hot_isolation(self) -> str | None:
        # The worker's claims and fenced writes need READ COMMITTED as much as begin_write's transactions do;
        # on its own long-lived connection that is set once, not sent before every transaction (a round trip
        # per batch, and the pool's reset on return another).
        return "READ COMMITTED"

    def begin_write(self, conn: Connection) -> None:
        """READ COMMITTED for this transaction: no gap locks (see the module docstring).

        ``SET TRANSACTION`` applies to the next transaction, which this
        connection has not started yet: it is the first statement sent.
        """
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")

    # -- the worker's path -----------------------------------------------------------

    def fenced(self, fences: Sequence[Fence] | Any) -> ColumnElement[bool]:
        # ``id IN (…)`` first: the optimizer reads the primary key for it, where a bare row-constructor
        # IN could scan the table; the pairs then check each token.
        fences = list(fences)
        t = self.jobs
        return (
            t.c.id.in_([f[0] for f in fences])
            & tuple_(t.c.id, t.c.claim_token).in_(fences)
            & (t.c.state == "running")
        )

    def skip_locked(self, stmt: Select[Any]) -> Select[Any]:
        return stmt.with_for_update(skip_locked=True)

    holder_lock: ClassVar[dict[str, Any] | None] = {"read": True}  # a locking read sees the latest commit

    def _in_turn_order(self, due: Select[Any]) -> Select[Any]:
        # A fair key's turn (drivers/_fair.py): MariaDB sorted every job of the key (filesort: 70 ms a turn at
        # 30,000) when the ORDER BY named the columns the WHERE fixes; on the index, told, it reads the turn.
        t = self.jobs
        return (due.with_hint(t, f"FORCE INDEX (ix_{t.name}_fair)")
                .order_by(t.c.priority.desc(), t.c.run_at, t.c.id))

    def by_state(self, stmt: Select[Any]) -> Select[Any]:
        # Under ORDER BY id DESC LIMIT, MariaDB walked the primary key from the newest row for the live jobs of a
        # `since` list: past a million finished rows when the pending jobs are few and the oldest.
        return stmt.with_hint(self.jobs, "IGNORE INDEX (PRIMARY)")

    def _take_turns(self, conn: Connection, turns: list[Select[Any]]) -> list[Any]:
        # Every key's turn in one round trip: (SELECT … LIMIT n FOR UPDATE SKIP LOCKED) UNION ALL (…); a claim
        # of a dozen keys was a dozen statements.
        return list(conn.execute(union_all(*turns))) if len(turns) > 1 else list(conn.execute(turns[0]))

    def _lock_fenced(self, conn: Connection, fences: Sequence[Fence], *columns: Any) -> list[Any]:
        """Lock the rows still held under ``fences`` (there is no UPDATE … RETURNING to tell us).

        Through the primary key, always: a few running rows are a small range of the claim and lease
        indexes, which the optimizer may prefer, and a locking read through one of those locks its
        entries before the rows. A handler's transaction finishing one of those jobs holds the row and then
        needs that entry (the state changes), so the two waited on each other and InnoDB rolled the
        handler's work back (tests/test_claim_plan.py).
        """
        t = self.jobs
        stmt = (select(*(columns or (t.c.id, t.c.claim_token))).with_hint(t, "FORCE INDEX (PRIMARY)")
                .where(self.fenced(fences)).with_for_update())
        return list(conn.execute(stmt))

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
        """Lock the due window with SKIP LOCKED, then take what the isolation rule allows."""
        if limit <= 0:
            return [], False
        t = self.jobs
        due = select(
            t.c.id, t.c.kind, t.c.queue, t.c.payload, t.c.attempts, t.c.max_attempts, t.c.priority, t.c.isolate
        ).where(t.c.state == "pending", t.c.run_at <= self.now())
        if queues:
            due = due.where(t.c.queue.in_(list(queues)))
        if skip_kinds:
            due = due.where(t.c.kind.not_in(list(skip_kinds)))
        if self.skip_queues:  # fair queues, claimed by drivers/_fair.py
            due = due.where(t.c.queue.not_in(self.skip_queues))
        due = due.order_by(t.c.priority.desc(), t.c.run_at, t.c.id).limit(limit)
        window = list(conn.execute(due.with_for_update(skip_locked=True)))  # in claim order
        isolated = [r for r in window if r.isolate]
        if alone and isolated:
            chosen, waiting = isolated[:1], len(isolated) > 1
        else:
            chosen, waiting = [r for r in window if not r.isolate], bool(isolated)
        if not chosen:
            return [], waiting
        stmt = (
            update(t)
            .where(t.c.id.in_([r.id for r in chosen]))
            .values(
                state="running",
                attempts=t.c.attempts + 1,
                locked_at=self.now(),
                locked_by=worker,
                claim_token=token,
                lease_expires_at=self.later(lease),
            )
        )
        conn.execute(stmt)  # the rows are ours (locked above): nobody changed them in between
        claimed = [
            Claimed(r.id, r.kind, r.queue, r.payload, r.attempts + 1, r.max_attempts, r.priority, token,
                    bool(r.isolate))
            for r in chosen
        ]
        return claimed, waiting

    def heartbeat(self, conn: Connection, fences: Sequence[Fence], lease: float) -> set[Fence]:
        if not fences:
            return set()
        held = self._lock_fenced(conn, fences)
        if held:
            t = self.jobs
            conn.execute(
                update(t).where(t.c.id.in_([r.id for r in held])).values(lease_expires_at=self.later(lease))
            )
        return {(r.id, r.claim_token) for r in held}

    def finish(self, conn: Connection, fences: Sequence[Fence]) -> set[int]:
        if not fences:
            return set()
        t = self.jobs
        held = self._lock_fenced(conn, fences, t.c.id, t.c.claim_token, t.c.has_dependents)
        if held:
            mine = t.c.id.in_([r.id for r in held])
            conn.execute(delete(t).where(mine) if self.discard_finished else update(t).where(mine).values(
                state="finished", finished_at=self.now(), lease_expires_at=None))
            upstreams = [r.id for r in held if r.has_dependents]
            if upstreams:
                self.unblock(conn, upstreams)
        return {r.id for r in held}

    def _count_down(self, conn: Connection, gone: Any, among: Any) -> int:
        # Two statements (Graph's one reads the old count in the SET of state): a multi-table UPDATE here gives its
        # SETs no order, so that one could read the count it just lowered, or not. The counts, then the release.
        t = self.jobs
        counted = conn.execute(update(t).where(t.c.id == gone.c.id, t.c.state == "blocked")
                               .values(waiting_for=t.c.waiting_for - gone.c.n)).rowcount
        self._release(conn, among)
        return int(counted)

    def errors_plus(self, entry: dict[str, Any]) -> ColumnElement[Any]:
        # JSON_EXTRACT(…, '$') makes the bound text a JSON value, so it is appended as an object, not a string.
        return text("JSON_ARRAY_APPEND(COALESCE(errors, '[]'), '$', JSON_EXTRACT(:entry, '$'))").bindparams(
            entry=json.dumps(entry)
        )

    def upsert(self, conn: Connection, table: Table, row: dict[str, Any] | list[dict[str, Any]],
               update: Sequence[str] = ()) -> None:
        # Nothing to update: the key set to itself (not INSERT IGNORE, which turns other errors into warnings).
        stmt = mysql.insert(table).values(row)
        first = table.primary_key.columns.values()[0]
        changes = {c: stmt.inserted[c] for c in update} or {first.name: first}
        conn.execute(stmt.on_duplicate_key_update(changes))

    def wake_waiting(self, conn: Connection, keys: Collection[str]) -> int:
        # A locking read first: REPEATABLE READ then reads the latest parked steps, not this transaction's snapshot.
        s, t = self.steps, self.jobs
        ids = list(conn.scalars(select(s.c.job_id).where(self.among(s.c.awaiting, keys), s.c.finished_at.is_(None))
                                .with_for_update()))
        now = self.now()
        woken = 0
        for start in range(0, len(ids), 1000):
            woken += conn.execute(update(t).where(t.c.id.in_(ids[start:start + 1000]), t.c.state == "pending")
                                  .values(run_at=case((t.c.run_at > now, now), else_=t.c.run_at))).rowcount
        return woken

    def dead_letter(self, conn: Connection, fence: Fence, error: str) -> bool:
        t, d = self.jobs, self.dead
        row = next(iter(self._lock_fenced(conn, [fence], t)), None)
        if row is None:
            return False
        conn.execute(delete(t).where(t.c.id == row.id))
        message = truncate(error)
        errors = [*(row.errors or []), {"attempt": row.attempts, "at": utcnow(), "error": message}]
        older = conn.execute(select(d.c.kind, d.c.last_error).where(d.c.id == row.id).with_for_update()).first()
        if older is not None:  # ids were reused (see Driver.dead_letter): replace it, keep a note
            conn.execute(delete(d).where(d.c.id == row.id))
            note = f"replaced an older dead job with the same id (kind {older.kind!r}): {older.last_error}"
            errors.insert(0, {"attempt": None, "at": utcnow(), "error": truncate(note)})
        conn.execute(
            insert(d).values(
                **{c: getattr(row, c) for c in DEAD_COLUMNS}, last_error=message, errors=errors, failed_at=self.now()
            )
        )
        if row.has_dependents:
            self.pass_on_failure(conn, [row.id], "dead")
        return True

    def requeue_dead(
        self, conn: Connection, *, ids: Sequence[int] | None = None, kind: str | None = None
    ) -> list[int]:
        d, t = self.dead, self.jobs
        stmt = select(d)
        if ids is not None:
            stmt = stmt.where(d.c.id.in_(list(ids)))
        if kind is not None:
            stmt = stmt.where(d.c.kind == kind)
        rows = list(conn.execute(stmt.with_for_update()))
        if not rows:
            return []
        conn.execute(delete(d).where(d.c.id.in_([r.id for r in rows])))
        note = f"requeued from the dead-letter table at {utcnow()}"
        conn.execute(
            insert(t),
            [
                {
                    "id": r.id, "kind": r.kind, "queue": r.queue, "payload": r.payload, "priority": r.priority,
                    "attempts": 0, "max_attempts": r.max_attempts, "created_at": r.created_at, "state": "pending",
                    "last_error": truncate(f"{r.last_error}\n[{note}]"), "errors": requeued_errors(r.errors),
                    "trace_context": r.trace_context, "sequence_key": r.sequence_key,
                    "fair_key": r.fair_key,
                }
                for r in rows
            ],
        )
        self.mark_upstreams(conn, [r.id for r in rows])  # the dead table keeps no has_dependents
        return sorted(r.id for r in rows)

    def purge_dead(self, conn: Connection, older_than: float, kind: str | None = None) -> int:
        """``Driver.purge_dead`` without ``DELETE … RETURNING`` (MySQL has none): the ids under lock, then delete."""
        d = self.dead
        old = select(d.c.id).where(d.c.failed_at < self.ago(older_than))
        if kind is not None:
            old = old.where(d.c.kind == kind)
        ids = list(conn.scalars(old.with_for_update()))
        if ids:
            conn.execute(delete(d).where(d.c.id.in_(ids)))
        self.pass_on_failure(conn, ids, "purged")
        return len(ids)

    def prune_batch(self, conn: Connection, older_than: float, limit: int) -> int:
        # MySQL cannot DELETE from a table with a LIMIT subquery on that same table: two statements.
        t = self.jobs
        old = (
            select(t.c.id)
            .where(
                t.c.finished_at < self.ago(older_than),
                t.c.finished_at.is_not(None),
                t.c.state.in_(("finished", "cancelled")),
            )
            .order_by(t.c.finished_at)
            .limit(limit)
        )
        ids = list(conn.execute(self.skip_locked(old)).scalars())
        if not ids:
            return 0
        gone = conn.execute(delete(t).where(t.c.id.in_(ids))).rowcount
        self.forget_edges(conn, ids)  # after: a batch row goes once its callbacks have left the table
        self.forget_steps(conn, ids)
        return gone

    def run_times(self, conn: Connection, window: float) -> list[tuple[str, int, float, float, float, float]]:
        """MariaDB's PERCENTILE_CONT is a window function only, MySQL has none: computed in Python."""
        t = self.jobs
        took = self.seconds_between(t.c.finished_at, t.c.locked_at)
        return run_times_in_python(conn.execute(select(t.c.kind, took).where(self.recently_finished(window))))
