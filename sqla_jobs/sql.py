"""Every statement sqla-jobs runs, and the only place where PostgreSQL and SQLite differ.

The rest of the package asks this module for a claim, a heartbeat, a finish;
it never writes SQL itself. Statements are built with SQLAlchemy Core against
the user's own tables, so custom table names and schemas need no special case.

Two rules hold for every write a worker makes after claiming:

* it is *fenced*: it names both the job id and the claim token it got at
  claim time, and the ``state = 'running'`` it expects, so a worker that lost
  its claim (lease expired, job re-claimed elsewhere) changes nothing;
* time comes from the database clock (``now()`` / ``strftime('now')``), never
  from the worker's, so lease arithmetic is right even when hosts disagree.

Dialect differences, all here:

=================  ==================================  =====================================
                   PostgreSQL                          SQLite
=================  ==================================  =====================================
claim              materialised CTE with               ``UPDATE … WHERE id IN (…)`` under
                   ``FOR UPDATE SKIP LOCKED``          ``BEGIN IMMEDIATE`` (database lock)
now / later        ``now()`` + interval                ``strftime('%f', 'now', '+N seconds')``
append an error    ``errors || jsonb``                 ``json_insert(errors, '$[#]', …)``
wake-up            ``pg_notify`` at commit             polling only
=================  ==================================  =====================================
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Interval,
    Table,
    and_,
    case,
    delete,
    func,
    insert,
    inspect,
    literal,
    select,
    text,
    tuple_,
    type_coerce,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from .errors import SchemaError

#: ``last_error`` and each entry of ``errors`` keep at most this many characters.
MAX_ERROR_LENGTH = 4000

Fence = tuple[int, str]  # (job id, claim token)


@dataclass(frozen=True, slots=True)
class Claimed:
    """What a worker needs from a freshly claimed row."""

    id: int
    kind: str
    queue: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    priority: int
    token: str

    @property
    def fence(self) -> Fence:
        return (self.id, self.token)


def truncate(message: str) -> str:
    if len(message) <= MAX_ERROR_LENGTH:
        return message
    return message[: MAX_ERROR_LENGTH - 15] + "… [truncated]"


_MIGRATE = (
    "this sqla-jobs version needs a schema migration; with alembic, run "
    "`sqla-jobs migrations render --app ... --url ...` (it writes a revision for exactly what is missing) "
    "and `alembic upgrade head`; see docs/howto/migrations.md"
)


def notify_channel(table: Table) -> str:
    """The LISTEN/NOTIFY channel of one jobs table (PostgreSQL caps names at 63 bytes)."""
    name = f"sqla_jobs.{table.schema}.{table.name}" if table.schema else f"sqla_jobs.{table.name}"
    return name[:63]


def notify(conn: Connection, table: Table) -> None:
    """Wake the workers listening on ``table`` when this transaction commits (PostgreSQL only)."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(notify_channel(table), "")))


class SQL:
    """The statements for one pair of tables on one backend."""

    def __init__(self, jobs: Table, dead: Table, dialect: str) -> None:
        self.jobs = jobs
        self.dead = dead
        self.postgres = dialect == "postgresql"
        self.sqlite = dialect == "sqlite"
        if not (self.postgres or self.sqlite):
            raise SchemaError(f"sqla-jobs supports PostgreSQL and SQLite, not {dialect!r}")
        self.channel = notify_channel(jobs)

    # -- time and transactions -------------------------------------------------

    def now(self) -> ColumnElement[datetime]:
        if self.postgres:
            return func.now()
        # Same text format SQLAlchemy writes, so comparisons as strings are right.
        return type_coerce(func.strftime("%Y-%m-%d %H:%M:%f000", "now"), DateTime(timezone=True))

    def later(self, seconds: float) -> ColumnElement[datetime]:
        if self.postgres:
            return func.now() + literal(timedelta(seconds=seconds), Interval())
        return type_coerce(
            func.strftime("%Y-%m-%d %H:%M:%f000", "now", f"{seconds:+.6f} seconds"),
            DateTime(timezone=True),
        )

    @contextmanager
    def write(self, engine: Engine) -> Iterator[Connection]:
        """A short write transaction; on SQLite it takes the database lock up front.

        A deferred SQLite transaction that reads and then writes can fail with
        SQLITE_BUSY when another process wrote in between; BEGIN IMMEDIATE
        waits (busy_timeout) for the lock instead, so the claim is atomic.
        """
        with engine.connect() as conn:
            if self.sqlite:
                conn.exec_driver_sql("PRAGMA busy_timeout = 30000")
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.rollback()
                raise
            conn.commit()

    def prepare(self, engine: Engine) -> None:
        """One-time settings: WAL lets SQLite readers and one writer work side by side."""
        if self.sqlite and engine.url.database not in (None, "", ":memory:"):
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
                conn.commit()

    def check_schema(self, conn: Connection) -> None:
        """Raise SchemaError naming what is missing, before a worker touches the tables."""
        inspector = inspect(conn)
        for table in (self.jobs, self.dead):
            if not inspector.has_table(table.name, schema=table.schema):
                raise SchemaError(
                    f"table {table.fullname!r} does not exist in {conn.engine.url.render_as_string()}: "
                    "create it with `sqla-jobs create-tables --app ...`, "
                    "`Base.metadata.create_all(engine)`, or your alembic migrations "
                    "(`sqla-jobs migrations render --app ...`, then `alembic upgrade head`)"
                )
            have = {c["name"] for c in inspector.get_columns(table.name, schema=table.schema)}
            missing = sorted(set(table.c.keys()) - have)
            if missing:
                raise SchemaError(
                    f"table {table.fullname!r} lacks column(s) {', '.join(missing)}: {_MIGRATE}"
                )
        # The claim and the lease reaper scan the whole table without these.
        wanted = [f"ix_{self.jobs.name}_pending", f"ix_{self.jobs.name}_running"]
        indexes = self._index_names(conn, inspector, self.jobs)
        absent = [name for name in wanted if name in {ix.name for ix in self.jobs.indexes} and name not in indexes]
        if absent:
            raise SchemaError(
                f"table {self.jobs.fullname!r} lacks index(es) {', '.join(absent)}: {_MIGRATE}; "
                "without alembic, `sqla-jobs create-tables --app ...` creates missing indexes"
            )

    def _index_names(self, conn: Connection, inspector: Any, table: Table) -> set[str]:
        if self.sqlite:
            # Some SQLAlchemy versions leave SQLite expression indexes (the claim index) out of reflection.
            master = f'"{table.schema}".sqlite_master' if table.schema else "sqlite_master"
            query = text(f"SELECT name FROM {master} WHERE type = 'index' AND tbl_name = :t")
            return set(conn.execute(query, {"t": table.name}).scalars())
        return {ix["name"] for ix in inspector.get_indexes(table.name, schema=table.schema) if ix["name"]}


    # -- the worker's path -----------------------------------------------------

    def claim(
        self, conn: Connection, limit: int, worker: str, token: str, lease: float, queues: Sequence[str] | None
    ) -> list[Claimed]:
        t = self.jobs
        due = select(t.c.id).where(t.c.state == "pending", t.c.run_at <= self.now())
        if queues:
            due = due.where(t.c.queue.in_(queues))
        due = due.order_by(t.c.priority.desc(), t.c.run_at, t.c.id).limit(limit)
        stmt = update(t).values(
            state="running",
            attempts=t.c.attempts + 1,
            locked_at=self.now(),
            locked_by=worker,
            claim_token=token,
            lease_expires_at=self.later(lease),
        )
        if self.postgres:
            # MATERIALIZED: the CTE runs once, so exactly `limit` rows are locked.
            # A plain `id IN (subquery … FOR UPDATE SKIP LOCKED)` may be re-run
            # by the planner and lock (and claim) more rows than asked for.
            picked = due.with_for_update(skip_locked=True).cte("due").prefix_with("MATERIALIZED")
            stmt = stmt.where(t.c.id == picked.c.id)
        else:
            stmt = stmt.where(t.c.id.in_(due.scalar_subquery()))
        stmt = stmt.returning(
            t.c.id, t.c.kind, t.c.queue, t.c.payload, t.c.attempts, t.c.max_attempts, t.c.priority, t.c.run_at
        )
        rows = sorted(conn.execute(stmt), key=lambda r: (-r.priority, r.run_at, r.id))
        return [Claimed(r.id, r.kind, r.queue, r.payload, r.attempts, r.max_attempts, r.priority, token) for r in rows]

    def _fenced(self, fences: Iterable[Fence]) -> ColumnElement[bool]:
        t = self.jobs
        return and_(tuple_(t.c.id, t.c.claim_token).in_(list(fences)), t.c.state == "running")

    def heartbeat(self, conn: Connection, fences: Sequence[Fence], lease: float) -> set[Fence]:
        """Extend the leases still held; returns those (the rest were lost)."""
        if not fences:
            return set()
        t = self.jobs
        stmt = update(t).where(self._fenced(fences)).values(lease_expires_at=self.later(lease))
        return {(r.id, r.claim_token) for r in conn.execute(stmt.returning(t.c.id, t.c.claim_token))}

    def finish(self, conn: Connection, fences: Sequence[Fence]) -> set[int]:
        """Mark jobs finished; returns the ids that were still ours."""
        if not fences:
            return set()
        t = self.jobs
        stmt = update(t).where(self._fenced(fences)).values(
            state="finished", finished_at=self.now(), lease_expires_at=None
        )
        return set(conn.execute(stmt.returning(t.c.id)).scalars())

    def _errors_plus(self, entry: dict[str, Any]) -> ColumnElement[Any]:
        item = json.dumps(entry)
        if self.postgres:
            return text("COALESCE(errors, '[]'::jsonb) || jsonb_build_array(CAST(:entry AS jsonb))").bindparams(
                entry=item
            )
        return text("json_insert(COALESCE(errors, '[]'), '$[#]', json(:entry))").bindparams(entry=item)

    def release(
        self,
        conn: Connection,
        fence: Fence,
        *,
        delay: float = 0.0,
        error: str | None = None,
        attempt: int | None = None,
        refund: bool = False,
        cancel: bool = False,
    ) -> bool:
        """Give a running job back: to ``pending`` after ``delay``, or ``cancelled``.

        Used for retries (with ``error``), snoozes and shutdown give-backs
        (``refund`` the attempt), and JobCancel (``cancel``). A job whose
        cancellation was requested while it ran ends ``cancelled`` either way.
        """
        t = self.jobs
        stopped = literal(cancel) | t.c.cancelled_at.is_not(None)
        values: dict[str, Any] = {
            "state": case((stopped, "cancelled"), else_="pending"),
            "finished_at": case((stopped, self.now()), else_=None),
            "run_at": self.later(delay) if delay else self.now(),
            "claim_token": None,
            "lease_expires_at": None,
        }
        if refund:
            values["attempts"] = t.c.attempts - 1
        if error is not None:
            message = truncate(error)
            values["last_error"] = message
            values["errors"] = self._errors_plus({"attempt": attempt, "at": _utcnow(), "error": message})
        stmt = update(t).where(self._fenced([fence])).values(**values)
        return conn.execute(stmt).rowcount == 1

    def give_back(self, conn: Connection, fences: Sequence[Fence]) -> int:
        """Shutdown: unfinished jobs go back to pending now, the interrupted attempt refunded."""
        return sum(self.release(conn, fence, refund=True) for fence in fences)

    def dead_letter(self, conn: Connection, fence: Fence, error: str) -> bool:
        """Move a job that used its last attempt to the dead-letter table, in the caller's transaction."""
        t = self.jobs
        row = conn.execute(delete(t).where(self._fenced([fence])).returning(*t.c)).first()
        if row is None:
            return False
        message = truncate(error)
        errors = [*(row.errors or []), {"attempt": row.attempts, "at": _utcnow(), "error": message}]
        conn.execute(
            insert(self.dead).values(
                id=row.id,
                kind=row.kind,
                queue=row.queue,
                payload=row.payload,
                priority=row.priority,
                attempts=row.attempts,
                max_attempts=row.max_attempts,
                created_at=row.created_at,
                run_at=row.run_at,
                last_error=message,
                errors=errors,
                failed_at=self.now(),
            )
        )
        return True

    def expired(self, conn: Connection, limit: int = 100) -> list[Any]:
        """Running jobs whose lease ran out (their worker died or lost the database)."""
        t = self.jobs
        stmt = (
            select(t.c.id, t.c.kind, t.c.attempts, t.c.max_attempts, t.c.claim_token, t.c.locked_by)
            .where(t.c.state == "running", t.c.lease_expires_at < self.now())
            .order_by(t.c.lease_expires_at)
            .limit(limit)
        )
        if self.postgres:
            stmt = stmt.with_for_update(skip_locked=True)
        return list(conn.execute(stmt))

    # -- dead-letter admin -----------------------------------------------------

    def requeue_dead(
        self, conn: Connection, *, ids: Sequence[int] | None = None, kind: str | None = None
    ) -> list[int]:
        """Move dead jobs (by id, by kind, or all when neither is given) back into the jobs table.

        Attempts start again from 0; ``last_error`` and ``errors`` keep the history.
        The job keeps its id: it came from the jobs table's sequence, so no new
        job can have taken it.
        """
        d, t = self.dead, self.jobs
        stmt = delete(d)
        if ids is not None:
            stmt = stmt.where(d.c.id.in_(list(ids)))
        if kind is not None:
            stmt = stmt.where(d.c.kind == kind)
        rows = list(conn.execute(stmt.returning(*d.c)))
        if not rows:
            return []
        note = f"requeued from the dead-letter table at {_utcnow()}"
        conn.execute(
            insert(t),
            [
                {
                    "id": r.id,
                    "kind": r.kind,
                    "queue": r.queue,
                    "payload": r.payload,
                    "priority": r.priority,
                    "attempts": 0,
                    "max_attempts": r.max_attempts,
                    "created_at": r.created_at,
                    "state": "pending",
                    "last_error": truncate(f"{r.last_error}\n[{note}]"),
                    "errors": r.errors,
                }
                for r in rows
            ],
        )
        notify(conn, t)
        return sorted(r.id for r in rows)


def _utcnow() -> str:
    # Only for the human-readable history in `errors`; never used for leases.
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
