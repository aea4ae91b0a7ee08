"""The schema check, admin and stats statements: portable Core, shared by every backend (mixed into ``Driver``).

Each stats query is shaped to stay on one of the partial indexes, so it reads
the live part of the table (pending, running, the stats window) and never the
millions of finished rows that pile up before pruning.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Select, Table, and_, delete, func, insert, inspect, select, update
from sqlalchemy.sql.elements import ColumnElement

from ..errors import SchemaError
from ._batches import batch_table


def utcnow() -> str:  # only for the human-readable history in `errors`; never used for leases
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def truncate(message: str) -> str:
    return message if len(message) <= MAX_ERROR_LENGTH else message[: MAX_ERROR_LENGTH - 15] + "… [truncated]"


def requeued_errors(errors: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A requeued job's error history: its failures so far and an entry for the requeue (no attempt number),
    so the attempts after it, which count from 1 again, are not read as the same attempts twice."""
    note = "requeued from the dead-letter table: attempts start again from 1"
    return [*(errors or []), {"attempt": None, "at": utcnow(), "error": note}]


#: ``last_error`` and each entry of ``errors`` keep at most this many characters.
MAX_ERROR_LENGTH = 4000

MIGRATE = (
    "this sqla-jobs version needs a schema migration; with alembic, run "
    "`sqla-jobs migrations render --app ... --url ...` (it writes a revision for exactly what is missing) "
    "and `alembic upgrade head`; see docs/howto/migrations.md"
)


class Operations:
    """Schema check, requeue, stats, inspect, cancel, retry, purge, prune.

    The backend supplies the clock (``now``/``ago``) and ``skip_locked``.
    """

    jobs: Table
    dead: Table

    if TYPE_CHECKING:  # Graph's (declared here for the type checker only: a stub here would win the MRO)
        @property
        def edges(self) -> Table: ...
        def with_dependents(self, conn: Connection, ids: Sequence[int], states: Sequence[str]) -> list[int]: ...
        def pass_on_failure(self, conn: Connection, upstreams: Sequence[int], ended: str) -> None: ...
        def mark_upstreams(self, conn: Connection, ids: Sequence[int]) -> None: ...
        def forget_edges(self, conn: Connection, pruned: Sequence[int]) -> None: ...
        def forget_steps(self, conn: Connection, job_ids: Sequence[int]) -> None: ...  # Durable's, as are:
        steps: Table
        events: Table

    def now(self) -> ColumnElement[datetime]:
        raise NotImplementedError

    def ago(self, seconds: float) -> ColumnElement[datetime]:
        raise NotImplementedError

    def seconds_between(self, later: Any, earlier: Any) -> ColumnElement[float]:
        raise NotImplementedError

    def notify(self, conn: Connection) -> None:
        """Wake waiting workers at commit (where they wait)."""

    def index_names(self, conn: Connection) -> set[str]:
        raise NotImplementedError

    def skip_locked(self, stmt: Select[Any]) -> Select[Any]:
        raise NotImplementedError

    def check_schema(self, conn: Connection) -> None:
        """Raise SchemaError naming what is missing, before a worker touches the tables."""
        inspector = inspect(conn)
        for table in (self.jobs, self.dead, self.edges, batch_table(self.jobs), self.steps, self.events,
                      self.sequences):  # type: ignore[attr-defined]
            if not inspector.has_table(table.name, schema=table.schema):
                raise SchemaError(
                    f"table {table.fullname!r} does not exist in {conn.engine.url.render_as_string()}: create it "
                    "with `sqla-jobs create-tables --app ...`, `Base.metadata.create_all(engine)`, or your alembic "
                    "migrations (`sqla-jobs migrations render --app ...`, then `alembic upgrade head`)")
            have = {c["name"] for c in inspector.get_columns(table.name, schema=table.schema)}
            missing = sorted(set(table.c.keys()) - have)
            if missing:
                raise SchemaError(f"table {table.fullname!r} lacks column(s) {', '.join(missing)}: {MIGRATE}")
        # The claim and the lease reaper scan the whole table without these.
        wanted = [f"ix_{self.jobs.name}_pending", f"ix_{self.jobs.name}_running"]
        indexes = self.index_names(conn)
        absent = [name for name in wanted if name in {ix.name for ix in self.jobs.indexes} and name not in indexes]
        if absent:
            raise SchemaError(
                f"table {self.jobs.fullname!r} lacks index(es) {', '.join(absent)}: {MIGRATE}; "
                "without alembic, `sqla-jobs create-tables --app ...` creates missing indexes"
            )

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
        note = f"requeued from the dead-letter table at {utcnow()}"
        conn.execute(
            insert(t),
            [
                {
                    "id": r.id, "kind": r.kind, "queue": r.queue, "payload": r.payload, "priority": r.priority,
                    "max_attempts": r.max_attempts, "created_at": r.created_at,
                    "trace_context": r.trace_context,  # the request that enqueued it: its first run is its child
                    "sequence_key": r.sequence_key,  # for people: its edges, not the key, keep its place
                    "fair_key": r.fair_key,
                    "state": "pending", "attempts": 0,
                    "last_error": truncate(f"{r.last_error}\n[{note}]"),
                    "errors": requeued_errors(r.errors),
                }
                for r in rows
            ],
        )
        self.mark_upstreams(conn, [r.id for r in rows])  # the dead table keeps no has_dependents
        return sorted(r.id for r in rows)

    # -- stats (sqla_jobs._stats) ---------------------------------------------------
    # Each query is shaped to stay on one of the partial indexes, so it reads the
    # live part of the table (pending, running, the stats window) and never the
    # millions of finished rows that pile up before pruning.

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

    def retrying_by_kind(self, conn: Connection) -> list[Any]:
        """Per kind: pending jobs that have failed at least once (waiting for their next attempt)."""
        t = self.jobs
        stmt = (
            select(t.c.kind, func.count().label("retrying"))
            .where(t.c.state == "pending", t.c.attempts > 0)  # the pending index's range, then a filter
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
        unique_key: str | None = None,
        sequence_key: str | None = None,
        limit: int = 50,
    ) -> list[Any]:
        """Newest first; with ``state`` the query stays on that state's partial index where one exists.

        ``unique_key`` matches the key itself and its periods (``key@<period start>``); ``sequence_key``
        reads ``ix_<jobs>_sequence`` (a sequence's jobs, newest first).
        """
        t = self.jobs
        stmt = select(t).order_by(t.c.id.desc()).limit(limit)
        if kind is not None:
            stmt = stmt.where(t.c.kind == kind)
        if state is not None:
            stmt = stmt.where(t.c.state == state)
        if queue is not None:
            stmt = stmt.where(t.c.queue == queue)
        if unique_key is not None:
            stmt = stmt.where(self.key_or_periods(unique_key))
        if sequence_key is not None:
            stmt = stmt.where(t.c.sequence_key == sequence_key)
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

    def distinct(self, conn: Connection, column: str, *, dead: bool = False, limit: int = 100) -> list[str]:
        """The distinct values of ``column`` (``kind``, ``queue``) in the jobs (or dead-letter) table, sorted.

        No index covers them: the admin commands ask only when a filter matched nothing or may be a typo.
        """
        c = (self.dead if dead else self.jobs).c[column]
        return list(conn.scalars(select(c).distinct().order_by(c).limit(limit)))

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
        for waiting in ("pending", "blocked"):
            stmt = (
                update(t)
                .where(t.c.id == job_id, t.c.state == waiting)
                .values(state="cancelled", cancelled_at=now, finished_at=now, lease_expires_at=None)
            )
            if conn.execute(stmt).rowcount == 1:
                if self.with_dependents(conn, [job_id], ["cancelled"]):
                    self.pass_on_failure(conn, [job_id], "cancelled")
                return True, waiting
        stmt = (
            update(t)
            .where(t.c.id == job_id, t.c.state == "running")
            .values(cancelled_at=func.coalesce(t.c.cancelled_at, now))
        )
        if conn.execute(stmt).rowcount == 1:
            self.notify(conn)  # where workers listen, the one running it asks at once, not at its next heartbeat
            return True, "running"
        state = conn.execute(select(t.c.state).where(t.c.id == job_id)).scalar()
        return False, None if state is None else str(state)

    def retry_now(self, conn: Connection, job_id: int) -> str | None:
        """Make a pending (scheduled) job due now. Returns ``"pending"`` when done, else the
        job's state (nothing changed), or None if there is no such job."""
        t = self.jobs
        stmt = update(t).where(t.c.id == job_id, t.c.state == "pending").values(run_at=self.now())
        if conn.execute(stmt).rowcount == 1:
            self.notify(conn)
            return "pending"
        state = conn.execute(select(t.c.state).where(t.c.id == job_id)).scalar()
        return None if state is None else str(state)

    def make_due(self, conn: Connection, kind: str | None = None) -> int:
        """Tests (``sqla_jobs.testing.make_due``): every pending job scheduled later (a delayed job, a retry
        in backoff) becomes due now, by the database clock; jobs due already keep their order."""
        t = self.jobs
        stmt = update(t).where(t.c.state == "pending", t.c.run_at > self.now()).values(run_at=self.now())
        if kind is not None:
            stmt = stmt.where(t.c.kind == kind)
        moved = conn.execute(stmt).rowcount
        if moved:
            self.notify(conn)
        return moved

    def purge_dead(self, conn: Connection, older_than: float, kind: str | None = None) -> int:
        """Delete dead jobs that failed more than ``older_than`` seconds ago."""
        d = self.dead
        stmt = delete(d).where(d.c.failed_at < self.ago(older_than))
        if kind is not None:
            stmt = stmt.where(d.c.kind == kind)
        ids = list(conn.scalars(stmt.returning(d.c.id)))
        self.pass_on_failure(conn, ids, "purged")  # a dependent waiting for one (on_upstream_failure="wait")
        return len(ids)

    # -- pruning ---------------------------------------------------------------------

    def prune_lock(self, conn: Connection) -> bool:
        """Take this table's prune lock for the transaction without waiting; False: another process prunes.

        By default the write transaction itself lets only one process in.
        """
        return True

    def prune_batch(self, conn: Connection, older_than: float, limit: int) -> int:
        """Delete up to ``limit`` finished or cancelled jobs whose ``finished_at`` is older than
        ``older_than`` seconds; the caller commits each batch so no lock is held for long."""
        t = self.jobs
        old = (select(t.c.id).where(t.c.finished_at < self.ago(older_than), t.c.finished_at.is_not(None),
                                    t.c.state.in_(("finished", "cancelled")))
               .order_by(t.c.finished_at).limit(limit))
        # A row another session is deleting right now is skipped, not waited for.
        gone = list(conn.scalars(delete(t).where(t.c.id.in_(self.skip_locked(old).scalar_subquery()))
                                 .returning(t.c.id)))
        self.forget_edges(conn, gone)
        self.forget_steps(conn, gone)
        return len(gone)

    # -- vacuum (sqla_jobs.worker.vacuum) ------------------------------------------------------

    def dead_rows(self, conn: Connection) -> int | None:
        """Dead row versions in the jobs table as the server counts them; None where a backend reclaims
        them itself (MariaDB's purge, SQLite's in-place updates) and nothing is left for a worker to do."""
        return None

    def may_vacuum(self, conn: Connection) -> bool:
        """Whether this connection's role may vacuum the jobs table (only asked where ``dead_rows`` counts)."""
        return False

    def vacuum(self, conn: Connection) -> None:
        """Reclaim the jobs table's dead rows now, unless another vacuum holds it (``conn`` in autocommit)."""

    # -- stats (sqla_jobs._stats) -------------------------------------------------------

    def recently_finished(self, window: float) -> ColumnElement[bool]:
        """Jobs finished within ``window`` seconds, as the ``ix_<table>_finished`` index's predicate allows."""
        t = self.jobs
        return and_(
            t.c.finished_at >= self.ago(window),
            t.c.finished_at.is_not(None),
            t.c.state == "finished",
            t.c.locked_at.is_not(None),
        )

    def run_times(self, conn: Connection, window: float) -> list[tuple[str, int, float, float, float, float]]:
        """Per kind, over jobs finished within ``window`` seconds: (kind, count, mean, p50, p95, max)."""
        raise NotImplementedError

