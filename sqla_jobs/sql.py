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
import zlib
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
    Text,
    and_,
    bindparam,
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
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateIndex, CreateSchema
from sqlalchemy.sql.elements import ColumnElement

from .errors import SchemaError

#: ``last_error`` and each entry of ``errors`` keep at most this many characters.
MAX_ERROR_LENGTH = 4000

Fence = tuple[int, str]  # (job id, claim token)


@dataclass(slots=True)  # not frozen: frozen dataclasses are several times slower to build
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
    #: Its last worker was lost while it ran: the worker runs it alone (see docs/guarantees.md).
    isolated: bool = False

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


# The worker's hot path on PostgreSQL, written out so it is built once and is
# one round trip. `done` finishes the last batch, fenced pair by pair (an
# `id = ANY(ids) AND token = ANY(tokens)` test could match a job we re-claimed
# under another token); the pairs travel as one "id:token,…" string because
# the driver's array adaptation was a quarter of the worker's time. `due` is
# MATERIALIZED so exactly `limit` rows are locked; `claimed` takes them, except
# jobs marked `isolate` (their worker was lost while they ran): an idle worker
# (`alone`) takes the most urgent of those and nothing else; a busy one leaves
# them and learns of them from the rows with `claimed` NULL (see Claim.isolated_waiting).
_PG_FINISH_AND_CLAIM = """
WITH done AS (
    UPDATE {table} AS j SET state = 'finished', finished_at = now(), lease_expires_at = NULL
    FROM (
        SELECT split_part(pair, ':', 1)::bigint AS id, split_part(pair, ':', 2) AS token
        FROM unnest(string_to_array(%(fences)s, ',')) AS pair
    ) AS f
    WHERE j.id = f.id AND j.claim_token = f.token AND j.state = 'running'
    RETURNING j.id
), due AS MATERIALIZED (
    SELECT id, isolate, priority, run_at FROM {table}
    WHERE state = 'pending' AND run_at <= now() {queue_filter}
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), alone AS (
    SELECT id FROM due WHERE isolate AND %(alone)s ORDER BY priority DESC, run_at, id LIMIT 1
), claimed AS (
    UPDATE {table} AS j
    SET state = 'running', attempts = j.attempts + 1, locked_at = now(), locked_by = %(worker)s,
        claim_token = %(token)s, lease_expires_at = now() + make_interval(secs => %(lease)s)
    FROM due WHERE j.id = due.id
        AND (due.id IN (SELECT id FROM alone) OR NOT (due.isolate OR EXISTS (SELECT FROM alone)))
    RETURNING j.id, j.kind, j.queue, j.payload, j.attempts, j.max_attempts, j.priority, j.run_at, j.isolate
)
SELECT true AS claimed, id, kind, queue, payload, attempts, max_attempts, priority, run_at, isolate FROM claimed
UNION ALL
SELECT false, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM done
UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM due
WHERE isolate AND id NOT IN (SELECT id FROM alone)
"""


def _pg_name(table: Table) -> str:
    """The table's name as PostgreSQL wants it in hand-written SQL: quoted where needed, with its schema."""
    from sqlalchemy.dialects import postgresql

    return str(postgresql.dialect().identifier_preparer.format_table(table))


def notify(conn: Connection, table: Table) -> None:
    """Wake the workers listening on ``table`` when this transaction commits (PostgreSQL only)."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_notify(notify_channel(table), "")))


def notify_trigger_name(table: Table) -> str:
    return f"{table.name}_notify"[:63]


def notify_trigger_ddl(table: Table) -> tuple[str, str]:
    """PostgreSQL DDL (create, drop) for the trigger that wakes workers on INSERT.

    A statement-level AFTER INSERT trigger: one NOTIFY per INSERT or COPY,
    delivered at commit, dropped on rollback, and no extra round trip for
    the application that enqueues. It also fires for rows inserted by
    plain SQL from other programs.
    """
    from sqlalchemy.dialects import postgresql

    preparer = postgresql.dialect().identifier_preparer
    target = _pg_name(table)
    schema = f"{preparer.quote_schema(table.schema)}." if table.schema else ""
    function = f"{schema}sqla_jobs_notify"
    trigger = preparer.quote(notify_trigger_name(table))
    channel = notify_channel(table).replace("'", "''")
    create = (
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_notify(TG_ARGV[0], ''); RETURN NULL; END $$;\n"
        f"CREATE TRIGGER {trigger} AFTER INSERT ON {target} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}('{channel}')"
    )
    drop = f"DROP TRIGGER IF EXISTS {trigger} ON {target}"
    return create, drop


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
        if self.postgres:
            self._pg_hot = {by_queue: _PG_FINISH_AND_CLAIM.format(
                table=_pg_name(jobs), queue_filter="AND queue = ANY(%(queues)s::text[])" if by_queue else ""
            ) for by_queue in (False, True)}

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
            self.begin_write(conn)
            try:
                yield conn
            except BaseException:
                conn.rollback()
                raise
            conn.commit()

    def begin_write(self, conn: Connection) -> None:
        """On SQLite, take the write lock now (waiting up to 30 s for it); elsewhere nothing to do."""
        if self.sqlite:
            conn.exec_driver_sql("PRAGMA busy_timeout = 30000")
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    def create(self, conn: Connection) -> None:
        """Create what is missing: the PostgreSQL schema, both tables, their indexes, the NOTIFY trigger.

        Tables made by an older sqla-jobs get the indexes and trigger added
        since; their columns are left alone (that takes a migration).
        """
        tables = [self.jobs, self.dead]
        if self.postgres:
            for schema in sorted({t.schema for t in tables if t.schema}):
                conn.execute(CreateSchema(schema, if_not_exists=True))
        for table in tables:
            table.create(conn, checkfirst=True)
            for index in table.indexes:
                conn.execute(CreateIndex(index, if_not_exists=True))
        if self.postgres and not self.has_notify_trigger(conn):
            conn.execute(text(notify_trigger_ddl(self.jobs)[0]))

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


    def has_notify_trigger(self, conn: Connection) -> bool:
        """Whether inserts into the jobs table wake workers (PostgreSQL; SQLite always polls)."""
        if not self.postgres:
            return False
        found = conn.execute(
            text("SELECT 1 FROM pg_trigger WHERE tgname = :name AND tgrelid = to_regclass(:target)"),
            {"name": notify_trigger_name(self.jobs), "target": _pg_name(self.jobs)},
        ).first()
        return found is not None

    # -- the worker's path -----------------------------------------------------

    def finish_and_claim(
        self,
        conn: Connection,
        fences: Sequence[Fence],
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        *,
        alone: bool = False,
    ) -> tuple[set[int], list[Claimed], bool]:
        """Mark ``fences`` finished and claim up to ``limit`` due jobs.

        Returns (finished ids, claimed, isolated_waiting). The worker's hot path.
        On PostgreSQL it is one statement, so one round trip per batch; elsewhere
        a few statements in one write transaction. Jobs marked ``isolate`` are
        claimed only with ``alone`` (the worker runs nothing), one at a time and
        with nothing else; ``isolated_waiting`` says such a job was among the
        most urgent ``limit`` and was left, so the worker should drain and claim alone.
        """
        if not self.postgres:
            claimed, waiting = self._sqlite_claim(conn, limit, worker, token, lease, queues, alone)
            return self.finish(conn, fences), claimed, waiting
        return self._pg_finish_and_claim(conn, fences, limit, worker, token, lease, queues, ordered=False, alone=alone)

    def _pg_finish_and_claim(
        self,
        conn: Connection,
        fences: Sequence[Fence],
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        *,
        ordered: bool,
        alone: bool = False,
    ) -> tuple[set[int], list[Claimed], bool]:
        params = {
            "fences": ",".join(f"{job_id}:{job_token}" for job_id, job_token in fences),
            "limit": limit,
            "worker": worker,
            "token": token,
            "lease": float(lease),
            "queues": list(queues or ()),
            "alone": alone,
        }
        # The driver's cursor directly: this runs once per batch, and SQLAlchemy's
        # result machinery was a fifth of the worker's time. Errors are wrapped
        # back into SQLAlchemy's, which is what the worker's retry loop expects.
        sql = self._pg_hot[bool(queues)]
        if not conn.in_transaction():
            # SQLAlchemy does not see what the driver cursor runs: without this its commit
            # (e.g. SQL.write's) would be a no-op and the pool would roll the claim back.
            conn.begin()
        try:
            with conn.connection.driver_connection.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(sql, params)
                rows = cursor.fetchall()
        except Exception as exc:
            if isinstance(exc, conn.dialect.loaded_dbapi.Error):
                raise DBAPIError.instance(sql, params, exc, conn.dialect.loaded_dbapi.Error) from exc
            raise
        finished = {r[1] for r in rows if r[0] is False}
        claimed = [r for r in rows if r[0]]
        waiting = any(r[0] is None for r in rows)  # an isolated job was left for an idle worker
        if ordered:  # the worker does not need it: a batch never exceeds its free threads, all start at once
            claimed.sort(key=lambda r: (-r[7], r[8], r[1]))
        jobs = [Claimed(r[1], r[2], r[3], r[4], r[5], r[6], r[7], token, bool(r[9])) for r in claimed]
        return finished, jobs, waiting

    def claim(
        self,
        conn: Connection,
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        *,
        alone: bool = False,
    ) -> list[Claimed]:
        """Claim up to ``limit`` due jobs, returned in claim order (most urgent, then oldest, first).

        Isolated jobs follow ``finish_and_claim``'s rule.
        """
        if self.postgres:  # the worker's own statement, so what is tested is what runs
            return self._pg_finish_and_claim(
                conn, [], limit, worker, token, lease, queues, ordered=True, alone=alone
            )[1]
        return self._sqlite_claim(conn, limit, worker, token, lease, queues, alone)[0]

    def _sqlite_claim(
        self,
        conn: Connection,
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        alone: bool,
    ) -> tuple[list[Claimed], bool]:
        """SQLite's claim, under BEGIN IMMEDIATE: choose among the due window, then take the rows."""
        if limit <= 0:
            return [], False
        t = self.jobs
        due = select(t.c.id, t.c.isolate).where(t.c.state == "pending", t.c.run_at <= self.now())
        if queues:
            due = due.where(t.c.queue.in_(queues))
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

    def insert_many(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert validated rows (payload already JSON text) in the caller's transaction.

        PostgreSQL: COPY, the fastest way in; SQLite: one executemany. Rows
        without ``run_at`` get the database clock, like ``Job(...)`` does.
        """
        t = self.jobs
        for timed in (False, True):
            batch = [r for r in rows if (r["run_at"] is not None) is timed]
            if not batch:
                continue
            columns = ["kind", "queue", "payload", "priority", "max_attempts"] + (["run_at"] if timed else [])
            if self.postgres:
                target = conn.dialect.identifier_preparer.format_table(t)
                cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
                with cursor.copy(f"COPY {target} ({', '.join(columns)}) FROM STDIN") as copy:
                    for r in batch:
                        copy.write_row([r[c] for c in columns])
            else:
                # The payload is bound as text: it is JSON already, no second encoding.
                stmt = insert(t).values(payload=bindparam("payload", type_=Text()))
                conn.execute(stmt, [{c: r[c] for c in columns} for r in batch])

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
        isolate: bool | None = False,
    ) -> bool:
        """Give a running job back: to ``pending`` after ``delay``, or ``cancelled``.

        Used for retries (with ``error``), snoozes and shutdown give-backs
        (``refund`` the attempt), and JobCancel (``cancel``). A job whose
        cancellation was requested while it ran ends ``cancelled`` either way.
        ``isolate``: its next run is alone in a worker process (True: its worker
        was lost), or not (False: a run ended, so any mark is cleared); None
        leaves the mark (a shutdown interrupted the run, it did not end it).
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
        if isolate is not None:
            values["isolate"] = isolate
        if error is not None:
            message = truncate(error)
            values["last_error"] = message
            values["errors"] = self._errors_plus({"attempt": attempt, "at": _utcnow(), "error": message})
        stmt = update(t).where(self._fenced([fence])).values(**values)
        return conn.execute(stmt).rowcount == 1

    def give_back(self, conn: Connection, fences: Sequence[Fence]) -> int:
        """Shutdown: unfinished jobs go back to pending now, the interrupted attempt refunded."""
        given = sum(self.release(conn, fence, refund=True, isolate=None) for fence in fences)
        if given:
            notify(conn, self.jobs)  # an UPDATE fires no trigger: wake the other workers here
        return given

    def dead_letter(self, conn: Connection, fence: Fence, error: str) -> bool:
        """Move a job that used its last attempt to the dead-letter table, in the caller's transaction."""
        t = self.jobs
        row = conn.execute(delete(t).where(self._fenced([fence])).returning(*t.c)).first()
        if row is None:
            return False
        message = truncate(error)
        errors = [*(row.errors or []), {"attempt": row.attempts, "at": _utcnow(), "error": message}]
        # A dead row with this id can only exist if ids were reused (a SQLite table rebuilt without
        # AUTOINCREMENT). Failing here would retry forever; replace it, and keep a note of it.
        d = self.dead
        older = conn.execute(delete(d).where(d.c.id == row.id).returning(d.c.kind, d.c.last_error)).first()
        if older is not None:
            note = f"replaced an older dead job with the same id (kind {older.kind!r}): {older.last_error}"
            errors.insert(0, {"attempt": None, "at": _utcnow(), "error": truncate(note)})
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
            select(t.c.id, t.c.kind, t.c.queue, t.c.attempts, t.c.max_attempts, t.c.claim_token, t.c.locked_by,
                   t.c.cancelled_at)
            .where(t.c.state == "running", t.c.lease_expires_at < self.now())
            .order_by(t.c.lease_expires_at)
            .limit(limit)
        )
        if self.postgres:
            stmt = stmt.with_for_update(skip_locked=True)
        return list(conn.execute(stmt))

    def held_by(self, conn: Connection, worker: str) -> list[Any]:
        """Running jobs claimed by ``worker`` (its process is known dead), same columns as ``expired``.

        Reads ``ix_<table>_running``. A row locked at this instant (the dead
        process's last statement still being undone) is skipped: its lease covers it.
        """
        t = self.jobs
        stmt = (
            select(t.c.id, t.c.kind, t.c.queue, t.c.attempts, t.c.max_attempts, t.c.claim_token, t.c.locked_by,
                   t.c.cancelled_at)
            .where(t.c.state == "running", t.c.locked_by == worker)
            .order_by(t.c.id)
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
        return sorted(r.id for r in rows)

    # -- stats (sqla_jobs.stats) ---------------------------------------------------
    # Each query is shaped to stay on one of the partial indexes, so it reads the
    # live part of the table (pending, running, the stats window) and never the
    # millions of finished rows that pile up before pruning.

    def seconds_between(self, later: Any, earlier: Any) -> ColumnElement[float]:
        """``later - earlier`` in seconds, as a float, computed by the database."""
        if self.postgres:
            return func.extract("epoch", later - earlier)
        return (func.julianday(later) - func.julianday(earlier)) * 86400.0

    def ago(self, seconds: float) -> ColumnElement[datetime]:
        """The database clock ``seconds`` ago."""
        return self.later(-seconds)

    def pending_by_queue(self, conn: Connection) -> list[Any]:
        """Per queue: ready and scheduled counts, and seconds since the oldest ready job became due.

        Reads only ``ix_<table>_pending`` (state = 'pending').
        """
        t, now = self.jobs, self.now()
        due = t.c.run_at <= now
        stmt = (
            select(
                t.c.queue,
                func.count().filter(due).label("ready"),
                func.count().filter(~due).label("scheduled"),
                func.min(t.c.run_at).filter(due).label("oldest_due"),
            )
            .where(t.c.state == "pending")
            .group_by(t.c.queue)
        )
        oldest = stmt.subquery()
        age = self.seconds_between(now, oldest.c.oldest_due)
        return list(
            conn.execute(
                select(oldest.c.queue, oldest.c.ready, oldest.c.scheduled, age.label("oldest_age")).order_by(
                    oldest.c.queue
                )
            )
        )

    def running_by_queue(self, conn: Connection) -> list[Any]:
        """Per queue: running jobs and how many of them have an expired lease (``ix_<table>_running``)."""
        t = self.jobs
        stmt = (
            select(
                t.c.queue,
                func.count().label("running"),
                func.count().filter(t.c.lease_expires_at < self.now()).label("expired"),
            )
            .where(t.c.state == "running")
            .group_by(t.c.queue)
            .order_by(t.c.queue)
        )
        return list(conn.execute(stmt))

    def dead_by_kind(self, conn: Connection, window: float) -> list[Any]:
        """Per kind: dead jobs in total and those dead-lettered within ``window`` seconds."""
        d = self.dead
        stmt = (
            select(
                d.c.kind,
                func.count().label("total"),
                func.count().filter(d.c.failed_at >= self.ago(window)).label("recent"),
            )
            .group_by(d.c.kind)
            .order_by(d.c.kind)
        )
        return list(conn.execute(stmt))

    def run_times(self, conn: Connection, window: float) -> list[Any]:
        """Per kind, over jobs finished within ``window`` seconds (``ix_<table>_finished``).

        PostgreSQL returns count, mean, p50, p95, max per kind; SQLite has no
        percentile function, so it returns one row per run (kind, seconds) and
        sqla_jobs.stats computes the same figures in Python.
        """
        t = self.jobs
        took = self.seconds_between(t.c.finished_at, t.c.locked_at)
        recent = and_(
            t.c.finished_at >= self.ago(window),
            t.c.finished_at.is_not(None),
            t.c.state == "finished",
            t.c.locked_at.is_not(None),
        )
        if self.sqlite:
            return list(conn.execute(select(t.c.kind, took.label("seconds")).where(recent)))
        stmt = (
            select(
                t.c.kind,
                func.count().label("count"),
                func.avg(took).label("mean"),
                func.percentile_cont(0.5).within_group(took).label("p50"),
                func.percentile_cont(0.95).within_group(took).label("p95"),
                func.max(took).label("max"),
            )
            .where(recent)
            .group_by(t.c.kind)
            .order_by(t.c.kind)
        )
        return list(conn.execute(stmt))

    # -- operations: inspect, cancel, retry, purge, prune ---------------------------

    def get_job(self, conn: Connection, job_id: int) -> Any:
        t = self.jobs
        return conn.execute(select(t).where(t.c.id == job_id)).first()

    def get_dead(self, conn: Connection, job_id: int) -> Any:
        d = self.dead
        return conn.execute(select(d).where(d.c.id == job_id)).first()

    def list_jobs(
        self,
        conn: Connection,
        *,
        kind: str | None = None,
        state: str | None = None,
        queue: str | None = None,
        limit: int = 50,
    ) -> list[Any]:
        """Newest first; with ``state`` the query stays on that state's partial index where one exists."""
        t = self.jobs
        stmt = select(t).order_by(t.c.id.desc()).limit(limit)
        if kind is not None:
            stmt = stmt.where(t.c.kind == kind)
        if state is not None:
            stmt = stmt.where(t.c.state == state)
        if queue is not None:
            stmt = stmt.where(t.c.queue == queue)
        return list(conn.execute(stmt))

    def list_dead(
        self, conn: Connection, *, kind: str | None = None, since: float | None = None, limit: int = 50
    ) -> list[Any]:
        """Dead jobs, most recently failed first; ``since``: failed within that many seconds."""
        d = self.dead
        stmt = select(d).order_by(d.c.failed_at.desc(), d.c.id.desc()).limit(limit)
        if kind is not None:
            stmt = stmt.where(d.c.kind == kind)
        if since is not None:
            stmt = stmt.where(d.c.failed_at >= self.ago(since))
        return list(conn.execute(stmt))

    def cancel(self, conn: Connection, job_id: int) -> tuple[bool, str | None]:
        """Cancel a job. Returns (changed, the state the job had): ``(True, "pending")`` it
        is now cancelled and will never run; ``(True, "running")`` the request is recorded in
        ``cancelled_at`` and honoured when the run ends; ``(False, state)`` nothing changed
        (finished, cancelled, or ``None``: no such job).

        The pending case is one fenced UPDATE: on PostgreSQL a claim in flight holds
        the row lock, this UPDATE waits for it, re-checks ``state = 'pending'`` and
        changes nothing; the running case then applies instead.
        """
        t = self.jobs
        now = self.now()
        stmt = (
            update(t)
            .where(t.c.id == job_id, t.c.state == "pending")
            .values(state="cancelled", cancelled_at=now, finished_at=now, lease_expires_at=None)
        )
        if conn.execute(stmt).rowcount == 1:
            return True, "pending"
        stmt = (
            update(t)
            .where(t.c.id == job_id, t.c.state == "running")
            .values(cancelled_at=func.coalesce(t.c.cancelled_at, now))
        )
        if conn.execute(stmt).rowcount == 1:
            return True, "running"
        state = conn.execute(select(t.c.state).where(t.c.id == job_id)).scalar()
        return False, None if state is None else str(state)

    def cancel_requested(self, conn: Connection, fence: Fence) -> bool:
        """Whether someone asked to cancel this (still ours) run while it ran."""
        t = self.jobs
        stmt = select(t.c.cancelled_at.is_not(None)).where(self._fenced([fence]))
        return bool(conn.execute(stmt).scalar())

    def finished_under(self, conn: Connection, fence: Fence) -> bool:
        """Whether the job was finished under this claim (the finish keeps the claim token)."""
        t = self.jobs
        stmt = select(t.c.id).where(t.c.id == fence[0], t.c.claim_token == fence[1], t.c.state == "finished")
        return conn.execute(stmt).first() is not None

    def errors_of(self, conn: Connection, fence: Fence) -> list[dict[str, Any]]:
        """The error history of this (still ours) run's job; empty if none or no longer ours."""
        t = self.jobs
        return list(conn.execute(select(t.c.errors).where(self._fenced([fence]))).scalar() or [])

    def retry_now(self, conn: Connection, job_id: int) -> str | None:
        """Make a pending (scheduled) job due now. Returns ``"pending"`` when done, else the
        job's state (nothing changed), or None if there is no such job."""
        t = self.jobs
        stmt = update(t).where(t.c.id == job_id, t.c.state == "pending").values(run_at=self.now())
        if conn.execute(stmt).rowcount == 1:
            notify(conn, t)
            return "pending"
        state = conn.execute(select(t.c.state).where(t.c.id == job_id)).scalar()
        return None if state is None else str(state)

    def purge_dead(self, conn: Connection, older_than: float, kind: str | None = None) -> int:
        """Delete dead jobs that failed more than ``older_than`` seconds ago."""
        d = self.dead
        stmt = delete(d).where(d.c.failed_at < self.ago(older_than))
        if kind is not None:
            stmt = stmt.where(d.c.kind == kind)
        return conn.execute(stmt).rowcount

    def prune_lock(self, conn: Connection) -> bool:
        """PostgreSQL: take this table's prune lock for the transaction, without waiting.

        False means another worker is pruning right now. On SQLite the write
        transaction (BEGIN IMMEDIATE) already lets only one process in.
        """
        if not self.postgres:
            return True
        key = zlib.crc32(f"sqla_jobs.prune.{self.jobs.fullname}".encode())
        return bool(conn.execute(select(func.pg_try_advisory_xact_lock(key))).scalar())

    def prune_batch(self, conn: Connection, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` finished or cancelled jobs whose ``finished_at`` is older than
        ``older_than`` seconds; the caller commits each batch so no lock is held for long."""
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
        if self.postgres:
            # A row another session is deleting right now is skipped, not waited for.
            old = old.with_for_update(skip_locked=True)
        return conn.execute(delete(t).where(t.c.id.in_(old.scalar_subquery()))).rowcount


def _utcnow() -> str:
    # Only for the human-readable history in `errors`; never used for leases.
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
