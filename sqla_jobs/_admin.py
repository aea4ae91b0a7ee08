"""The app's operations half: enqueue, inspect, cancel, retry, requeue, purge, prune, stats, tables.

``JobQueue`` (``sqla_jobs._app``) is the registry of ``sqla_jobs._registry`` plus these
methods. Each one checks its arguments, asks the app's driver (``sqla_jobs.drivers``:
every SQL statement lives there) to do the work on the caller's connection, and turns
the driver's answer into a result or a clear error. Methods taking a ``Session`` run in
the caller's transaction (``prune`` and ``create_tables`` take an ``Engine``, and commit).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from . import _periodic
from ._batch import Batch, add_members
from ._durable_admin import DurableAdmin
from ._fair import fill_row_key, keys_for_all
from ._fields import check_row
from ._models import STATES, JobMixin
from ._sequence import insert_sequenced
from ._stats import QueueStats, collect
from ._typed import as_payload
from ._unique import PERIOD_UNIQUE_STATES, Enqueued, check_key, check_on_duplicate, insert_or_update, period_key
from .drivers import Driver
from .errors import ConfigError, InvalidJob, JobStateError, NotFound

if TYPE_CHECKING:
    from ._registry import Handler

__all__ = ["Admin"]

J = TypeVar("J", bound=JobMixin)
# How many lost races (deadlocks) one prune survives before it reports the error.
_PRUNE_CONFLICT_RETRIES = 20
# How many times enqueue_unique tries again when the key's holder ended between its INSERT and its read.
_UNIQUE_RACE_RETRIES = 10


class Admin(DurableAdmin, Generic[J]):
    """Admin operations on one jobs table and its dead-letter table (a mixin of ``JobQueue``)."""

    job_model: type[J]

    if TYPE_CHECKING:  # provided by JobQueue (sqla_jobs._app) and its registry half
        handlers: dict[str, Handler]
        tracing: Any  # the registry's: None, or what sqla_jobs.otel.instrument set

        def driver(self, bind: Engine | Connection) -> Driver: ...

        def check_job(self, job: Any) -> None: ...

    # -- tables ------------------------------------------------------------------

    def create_tables(self, engine: Engine, *, partitioned: bool = False) -> None:
        """Create the two tables (and their PostgreSQL schema) and their indexes if missing; for apps without alembic.

        Existing tables are not altered otherwise: a column added by a newer
        sqla-jobs needs a migration (see docs/howto/migrations.md).
        ``partitioned`` (PostgreSQL): a new jobs table is partitioned so finished
        jobs leave the hot table (see docs/howto/partitioning.md).
        """
        _not_async(engine, "create_tables")
        with engine.begin() as conn:
            if partitioned:
                self.driver(conn).create_partitioned(conn)
            else:
                self._create_tables_on(conn)
        self.driver(engine).prepare(engine)

    def _create_tables_on(self, conn: Connection) -> None:
        self.driver(conn).create(conn)

    def check_schema(self, engine: Engine) -> None:
        """Raise ``SchemaError`` saying what to run when the tables are missing or out of date."""
        _not_async(engine, "check_schema")
        with engine.connect() as conn:
            self._check_schema_on(conn)

    def _check_schema_on(self, conn: Connection) -> None:
        self.driver(conn).check_schema(conn)

    # -- enqueue, in the caller's transaction ----------------------------------------

    def enqueue(self, session: Session, kind: str, payload: dict[str, Any] | None = None, **fields: Any) -> J:
        """Add a job to ``session`` (same as ``session.add(Job(...))``) and return it. With ``unique_key=`` it
        is ``enqueue_unique(...).job``: the new job, or the one that holds the key; a duplicate never fails the
        transaction."""
        if fields.get("unique_key") is not None:
            _not_async(session, "enqueue")
            return self.enqueue_unique(session, kind, payload, **fields).job
        if "on_duplicate" in fields:
            raise InvalidJob("on_duplicate was given without a unique_key: set unique_key too, or drop it")
        job = self.job_model(kind=kind, payload={} if payload is None else payload, **fields)
        session.add(job)
        return job

    def enqueue_unique(
        self,
        session: Session,
        kind: str,
        payload: dict[str, Any] | None = None,
        *,
        unique_key: str,
        unique_states: Sequence[str] | None = None,
        unique_period: float | None = None,
        on_duplicate: str = "keep",
        **fields: Any,
    ) -> Enqueued[J]:
        """Insert a job unless another job holds ``unique_key``; never aborts the caller's transaction.

        Returns ``Enqueued(job, inserted, id)``: the new job, or the job that holds the key. ``unique_states``
        (default pending and running) are the states in which the new job holds its key; add ``"finished"``
        (and/or ``"cancelled"``) to keep it after the run. ``unique_period`` (seconds) appends the period's start
        to the key and keeps finished jobs holding it: at most one job per key per period. The database's unique
        index decides, so concurrent callers in any number of processes get exactly one row.
        ``on_duplicate``: what a duplicate does to a *pending* holder, ``"keep"`` (nothing), ``"replace"``
        (the new payload), ``"debounce"`` (the new payload and, later, ``run_at``: it needs one); a running holder
        is never changed (``Enqueued.updated`` is False). See docs/howto/unique-jobs.md.
        """
        _not_async(session, "enqueue_unique")
        check_key(unique_key)  # a bad key fails here, whichever path it takes
        check_on_duplicate(on_duplicate, fields.get("run_at"))
        if unique_period is not None:
            unique_key = period_key(unique_key, unique_period)
            unique_states = PERIOD_UNIQUE_STATES if unique_states is None else unique_states
        item = {"kind": kind, "payload": {} if payload is None else payload, **fields,
                "unique_key": unique_key, "unique_states": unique_states}
        row = self._checked_row(item)
        session.flush()  # jobs added earlier in this session go first, as with enqueue_many
        conn = session.connection()
        driver = self.driver(conn)
        for _ in range(_UNIQUE_RACE_RETRIES):
            new_id, updated = insert_or_update(driver, conn, row, on_duplicate)
            found = new_id if new_id is not None else driver.unique_holder(conn, row["unique_key"])
            if found is not None:
                job = session.get(self.job_model, found, with_for_update=driver.holder_lock, populate_existing=updated)
                if job is not None:
                    return Enqueued(job, new_id is not None, found, updated)
            # The holder ended between our INSERT and the read: the key is free, try again.
        raise JobStateError(f"unique key {row['unique_key']!r} changed holder {_UNIQUE_RACE_RETRIES} times while "
                            "enqueueing; retry the transaction")

    def _checked_row(self, item: Mapping[str, Any]) -> dict[str, Any]:
        row = check_row(self.job_model, item)  # the payload comes back encoded, once
        self.check_job(SimpleNamespace(**{**row, "payload": (payload := as_payload(item.get("payload", {})))}))
        fill_row_key(self._fill_key, row, payload)
        if self.tracing is not None:  # sqla_jobs.otel: the caller's span, as JSON text like the payload
            row["trace_context"] = self.tracing.carrier()
        return row

    def enqueue_many(self, session: Session, jobs: Iterable[Mapping[str, Any]], *,
                     batch: Batch | int | None = None) -> int:
        """Insert many jobs fast, in ``session``'s transaction; returns how many.

        Each item is a mapping with ``kind`` and optionally ``payload``, ``queue``, ``priority``,
        ``max_attempts``, ``run_at``, ``unique_key``, ``unique_states``, ``on_duplicate``, ``sequence_key``,
        ``on_upstream_failure`` and ``fair_key`` (or a fair queue's ``key_field`` in the payload), checked like
        ``Job(...)`` (``check_job`` too): one bad item fails the call first. PostgreSQL loads them with COPY.
        No ORM objects are made, so ids are not returned; use ``session.add_all`` when you need them. Items with
        a ``unique_key`` are inserted one by one like ``enqueue_unique``, after the items without one: one whose
        key is held (by an existing job or an earlier item) is skipped, and the count leaves it out. ``batch``
        (a ``Batch``, or a batch's id): the jobs are its members (``sqla_jobs._batch``).
        """
        _not_async(session, "enqueue_many")
        rows = keys_for_all([self._checked_row(item) for item in jobs])
        session.flush()  # keep the order of jobs added earlier in this session
        conn = session.connection()
        driver = self.driver(conn)
        if batch is not None:
            return add_members(session, driver, self.job_model.__table__, batch, rows)  # type: ignore[attr-defined]
        plain = [row for row in rows if row["unique_key"] is None and "sequence_key" not in row]
        if plain:
            driver.insert_many(conn, plain)
        sequenced = insert_sequenced(conn, driver, [row for row in rows if "sequence_key" in row])
        keyed = sum(insert_or_update(driver, conn, row, row.get("on_duplicate", "keep"))[0] is not None
                    for row in rows if row["unique_key"] is not None)
        return len(plain) + len(sequenced) + keyed

    def enqueue_periodic(self, engine: Engine, *, now: datetime | None = None) -> list[J]:
        """Enqueue every schedule's due slot now (what each worker does on its own); returns the jobs inserted.

        ``now`` (aware) stands in for the clock, e.g. in tests. One short
        transaction per schedule, committed here.
        """
        _not_async(engine, "enqueue_periodic")
        return _periodic.enqueue_due(self, engine, now)  # type: ignore[arg-type]

    # -- reads -------------------------------------------------------------------

    def stats(
        self, bind: Session | Engine | Connection, *, window: float = 3600.0, run_times: bool = True
    ) -> QueueStats:
        """Queue lengths, oldest pending age, dead letters and run times; see docs/howto/monitoring.md."""
        with _connection(bind) as conn:
            return collect(self.driver(conn), conn, window, run_times=run_times)

    def get_job(self, session: Session, job_id: int) -> Any:
        """The job's row (all columns), or None. Reads the table, not the session's identity map."""
        _not_async(session, "get_job")
        conn = session.connection()
        return self.driver(conn).get_job(conn, job_id)

    def result(self, session: Session, job_id: int) -> Any:
        """What the handler of a finished job returned (JSON as stored; None if it returned None).

        Raises NotFound (no such job, or it is in the dead-letter table) or
        JobStateError when the job has not finished (pending, running) or was cancelled.
        """
        conn = session.connection()
        found = self.driver(conn).result_of(conn, job_id)
        if found is None:
            raise NotFound(self._not_found(conn, job_id))
        state, value = found
        if state != "finished":
            why = "was cancelled: it has no result" if state == "cancelled" else f"is {state}: it has no result yet"
            raise JobStateError(f"job {job_id} {why}")
        return value

    def get_dead(self, session: Session, job_id: int) -> Any:
        """The dead job's row (all columns), or None."""
        _not_async(session, "get_dead")
        conn = session.connection()
        return self.driver(conn).get_dead(conn, job_id)

    def list_jobs(
        self,
        session: Session,
        *,
        kind: str | None = None,
        state: str | None = None,
        queue: str | None = None,
        unique_key: str | None = None, sequence_key: str | None = None,
        limit: int = 50,
    ) -> list[Any]:
        """Jobs newest first, filtered by kind / state / queue name / unique key (its periods too) / sequence."""
        if state is not None and state not in STATES:
            raise ConfigError(f"unknown state {state!r}; choose from {', '.join(STATES)}")
        _not_async(session, "list_jobs")
        conn = session.connection()
        return self.driver(conn).list_jobs(conn, kind=kind, state=state, queue=queue, unique_key=unique_key,
                                           sequence_key=sequence_key, limit=limit)

    def list_dead(
        self, session: Session, *, kind: str | None = None, since: float | None = None, limit: int = 50
    ) -> list[Any]:
        """Dead jobs, latest failure first; ``since``: only those that failed within that many seconds."""
        _not_async(session, "list_dead")
        conn = session.connection()
        return self.driver(conn).list_dead(conn, kind=kind, since=since, limit=limit)

    # -- changes, in the caller's transaction -------------------------------------------

    def cancel(self, session: Session, job_id: int) -> str:
        """Cancel a job, in the caller's transaction.

        Returns ``"cancelled"`` for a pending or blocked job (it will never run) or
        ``"requested"`` for a running one: ``cancelled_at`` is recorded, and
        the worker running it tells its handler at its next heartbeat (at once
        on PostgreSQL, where the request notifies listening workers)
        (``current_job().cancelled`` is set, an async handler gets
        ``CancelledError``). From then on the job ends ``cancelled`` however
        the handler stops (it returns, raises, or ignores the request and runs
        to its end: a worker never kills a thread), with no retry, no dead
        letter and no result stored. A run that fails, times out, snoozes or
        loses its worker before the request reaches it ends ``cancelled`` too;
        one that succeeds before then ends ``finished`` (its work is done) and
        keeps ``cancelled_at`` as the record that the request came too late.
        See docs/howto/cancelling.md.
        Raises NotFound, or JobStateError for a finished or cancelled job.
        """
        _not_async(session, "cancel")
        conn = session.connection()
        changed, state = self.driver(conn).cancel(conn, job_id)
        if state is None:
            raise NotFound(self._not_found(conn, job_id))
        if not changed:
            raise JobStateError(f"job {job_id} is {state} already: there is nothing to cancel")
        return "cancelled" if state in ("pending", "blocked") else "requested"

    def retry_now(self, session: Session, job_id: int) -> None:
        """Make a pending job (a retry in backoff, a delayed job) due now, in the caller's transaction."""
        _not_async(session, "retry_now")
        conn = session.connection()
        result = self.driver(conn).retry_now(conn, job_id)
        if result is None:
            raise NotFound(self._not_found(conn, job_id))
        if result != "pending":
            hint = " (it is running now)" if result == "running" else ""
            raise JobStateError(f"job {job_id} is {result}{hint}: only a pending job can be made due now")

    def requeue_dead(
        self, session: Session, *, ids: list[int] | None = None, kind: str | None = None, everything: bool = False
    ) -> list[int]:
        """Move dead jobs back to the jobs table: by ``ids``, by ``kind``, or ``everything``.

        Attempts restart at 0; the error history stays. Returns the ids moved.
        Raises NotFound when ``ids`` names a job that is not dead.
        """
        if ids is None and kind is None and not everything:
            raise ConfigError("requeue_dead needs ids=, kind= or everything=True")
        _not_async(session, "requeue_dead")
        conn = session.connection()
        moved = self.driver(conn).requeue_dead(conn, ids=ids, kind=kind)
        if ids is not None:
            missing = sorted(set(ids) - set(moved))
            if missing:
                raise NotFound(f"no dead job with id {', '.join(map(str, missing))}")
        return moved

    def purge_dead(self, session: Session, *, older_than: float, kind: str | None = None) -> int:
        """Delete dead jobs that failed more than ``older_than`` seconds ago; returns how many."""
        if older_than < 0:
            raise ConfigError("older_than must be >= 0 seconds")
        _not_async(session, "purge_dead")
        conn = session.connection()
        return self.driver(conn).purge_dead(conn, older_than, kind)

    def prune(self, engine: Engine, *, older_than: float, batch_size: int = 1000, max_batches: int | None = None,
              ) -> int:
        """Delete finished and cancelled jobs finished over ``older_than`` seconds ago (their durable steps too),
        events emitted as long ago, and up to ``batch_size`` sequence keys whose last job has ended.

        Deletes ``batch_size`` rows per transaction, committing each (no long transaction on a busy table);
        stops after ``max_batches`` when given; returns how many rows were deleted. On PostgreSQL, when another
        process is pruning the same table it returns at once (a try-advisory lock)."""
        _not_async(engine, "prune")
        if older_than < 0 or batch_size < 1:
            raise ConfigError("prune needs older_than >= 0 seconds and batch_size >= 1")
        driver = self.driver(engine)
        deleted = batches = conflicts = 0
        while max_batches is None or batches < max_batches:
            try:
                with driver.write(engine) as conn:
                    if not driver.prune_lock(conn):
                        break
                    count = driver.prune_batch(conn, older_than, batch_size)
            except DBAPIError as exc:
                # Two pruners (or a pruner and a worker) can deadlock on InnoDB; the loser's
                # batch was rolled back whole, so running it again is safe and is the cure.
                conflicts += 1
                if not driver.is_conflict(exc) or conflicts > _PRUNE_CONFLICT_RETRIES:
                    raise
                continue
            deleted += count
            batches += 1
            if count < batch_size:
                break
        with driver.write(engine) as conn:  # durable jobs' events as old; ended sequences' rows (a batch a call)
            driver.prune_events(conn, datetime.now(timezone.utc) - timedelta(seconds=older_than))
            driver.prune_sequences(conn, batch_size)
        return deleted

    def _not_found(self, conn: Connection, job_id: int) -> str:
        if self.driver(conn).get_dead(conn, job_id) is not None:
            return f"job {job_id} is in the dead-letter table: see `sqla-jobs dead show {job_id}`"
        return f"no job with id {job_id}"


@contextmanager
def _connection(bind: Session | Engine | Connection) -> Iterator[Connection]:
    if isinstance(bind, Session):
        yield bind.connection()
    elif isinstance(bind, Connection):
        yield bind
    elif isinstance(bind, Engine):
        with bind.connect() as conn:
            yield conn
    else:
        _not_async(bind, "stats")
        raise ConfigError(f"expected a Session, Engine or Connection, got {type(bind).__name__}")


def _not_async(bind: object, name: str) -> None:
    """A clear error, instead of an un-awaited coroutine, for an asyncio object given to a sync method."""
    # Whoever made an AsyncSession imported SQLAlchemy's asyncio module; importing it here would need
    # greenlet (the asyncio extra) in every app.
    aio = sys.modules.get("sqlalchemy.ext.asyncio")
    if aio is None:
        return
    if isinstance(bind, (aio.AsyncSession, aio.AsyncConnection)) or (
        isinstance(bind, aio.AsyncEngine) and name in _AIO_ENGINE_METHODS
    ):
        raise ConfigError(f"queue.{name} was given an {type(bind).__name__}: call "
                          f"`await queue.aio.{name}(...)` instead (see docs/howto/asyncio.md)")
    if isinstance(bind, aio.AsyncEngine):
        raise ConfigError(f"queue.{name} has no asyncio form: give it a sync Engine on the same database "
                          "(create_engine with the same URL; see docs/howto/asyncio.md)")


# The engine methods queue.aio (sqla_jobs._async_admin) has; the others take a sync Engine only.
_AIO_ENGINE_METHODS = ("create_tables", "check_schema", "stats")
