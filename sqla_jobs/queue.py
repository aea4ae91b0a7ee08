"""The application object: which handler runs which kind, and what happens around it.

::

    queue = JobQueue(Job, DeadJob)

    @queue.handler("send_email")
    def send_email(payload: dict) -> None:
        ...

    @queue.handler("charge", timeout=30, backoff=Backoff(base=10), transactional=True)
    def charge(payload: dict) -> None:
        current_job().session.add(Payment(...))   # commits with the job's completion

    @queue.on("dead_letter")
    def count_dead(event: JobEvent) -> None:
        statsd.incr("jobs.dead_letter", tags=[f"kind:{event.kind}"])

Point a worker at it with ``sqla-jobs worker --app myapp.jobs:queue``.

While a ``JobQueue`` with handlers exists for a model, adding a ``Job`` whose
kind has no handler fails at flush with the list of known kinds, so a typo
never reaches the table. Pass ``check_kinds=False`` when the process that
enqueues does not import the handlers.

Events (``queue.on(name)``): ``started``, ``finished``, ``failed`` (a retry is
scheduled), ``dead_letter``, ``cancelled``, ``snoozed``, ``lost`` (the worker
lost its claim and discarded the result). A hook that raises is logged and
ignored: it never fails a job.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from ._backoff import Backoff
from ._models import STATES, DeadJobMixin, JobMixin, check_row
from ._stats import QueueStats, collect
from .drivers import Driver, driver_for
from .errors import ConfigError, InvalidJob, JobStateError, NotFound

__all__ = ["EVENTS", "Handler", "JobEvent", "JobQueue"]

log = logging.getLogger("sqla_jobs")

EVENTS = ("started", "finished", "failed", "dead_letter", "cancelled", "snoozed", "lost")

J = TypeVar("J", bound=JobMixin)
D = TypeVar("D", bound=DeadJobMixin)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Handler:
    """A registered handler and its per-kind options."""

    kind: str
    fn: Callable[..., Any]
    timeout: float | None
    backoff: Backoff | None
    transactional: bool
    is_async: bool


@dataclass(frozen=True)
class JobEvent:
    """What a hook is told. ``duration`` (seconds) and ``error`` are set when known."""

    name: str
    id: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    duration: float | None = None
    error: str | None = None


class JobQueue(Generic[J, D]):
    """Handlers, hooks and admin operations for one jobs table and its dead-letter table."""

    def __init__(
        self,
        job_model: type[J],
        dead_model: type[D],
        *,
        backoff: Backoff | None = None,
        check_kinds: bool = True,
    ) -> None:
        if not (isinstance(job_model, type) and issubclass(job_model, JobMixin)):
            raise ConfigError(f"JobQueue's first argument must be a JobMixin model, got {job_model!r}")
        if not (isinstance(dead_model, type) and issubclass(dead_model, DeadJobMixin)):
            raise ConfigError(f"JobQueue's second argument must be a DeadJobMixin model, got {dead_model!r}")
        self.job_model = job_model
        self.dead_model = dead_model
        self.backoff = backoff or Backoff()
        self.check_kinds = check_kinds
        self.handlers: dict[str, Handler] = {}
        self._hooks: dict[str, list[Callable[[JobEvent], Any]]] = {name: [] for name in EVENTS}
        self._drivers: dict[type[Any], Driver] = {}
        # The before_insert check in models.py finds the queues of a model here.
        job_model.__sqla_jobs_queues__ = (*getattr(job_model, "__sqla_jobs_queues__", ()), self)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<JobQueue {self.job_model.__name__}/{self.dead_model.__name__} kinds={sorted(self.handlers)}>"

    # -- registration ------------------------------------------------------------

    def handler(
        self,
        kind: str,
        *,
        timeout: float | None = None,
        backoff: Backoff | None = None,
        transactional: bool = False,
    ) -> Callable[[F], F]:
        """Register ``fn(payload)`` as the handler of ``kind``.

        ``timeout`` (seconds): a run that takes longer counts as failed and its
        late result is discarded. ``backoff`` overrides the queue's retry
        delays for this kind. ``transactional``: see ``current_job().session``.
        ``async def`` handlers are run on an event loop in the worker thread.
        """
        if not isinstance(kind, str) or not kind.strip():
            raise ConfigError(f"handler kind must be a non-empty string, got {kind!r}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"handler {kind!r}: timeout must be > 0 seconds")

        def register(fn: F) -> F:
            if kind in self.handlers:
                raise ConfigError(f"kind {kind!r} already has a handler: {self.handlers[kind].fn!r}")
            is_async = inspect.iscoroutinefunction(fn)
            if transactional and is_async:
                raise ConfigError(f"handler {kind!r}: transactional handlers must be plain functions")
            self.handlers[kind] = Handler(kind, fn, timeout, backoff, transactional, is_async)
            return fn

        return register

    def on(self, event: str) -> Callable[[F], F]:
        """Register a hook ``fn(JobEvent)`` for one of ``EVENTS``."""
        if event not in self._hooks:
            raise ConfigError(f"unknown event {event!r}; choose from {', '.join(EVENTS)}")

        def register(fn: F) -> F:
            self._hooks[event].append(fn)
            return fn

        return register

    def listens(self, event: str) -> bool:
        """Whether any hook is registered for ``event`` (lets the worker skip building events)."""
        return bool(self._hooks[event])

    def off(self, event: str, fn: Callable[[JobEvent], Any]) -> None:
        """Remove a hook added with ``on`` (no error if it is not there)."""
        if fn in self._hooks.get(event, []):
            self._hooks[event].remove(fn)

    def emit(self, event: JobEvent) -> None:
        for hook in self._hooks[event.name]:
            try:
                hook(event)
            except Exception:
                log.exception("hook %r for %s raised; ignored", hook, event.name)

    def retry_delay(self, kind: str, failures: int) -> float:
        handler = self.handlers.get(kind)
        policy = handler.backoff if handler and handler.backoff else self.backoff
        return policy.delay(failures)

    def unknown_kind_message(self, kind: str) -> str:
        known = ", ".join(sorted(self.handlers)) or "(none registered)"
        return f"no handler for kind {kind!r}; known kinds: {known}. Register one with @queue.handler({kind!r})"

    def _check_kind_known(self, kind: str) -> None:
        if self.check_kinds and self.handlers and kind not in self.handlers:
            raise InvalidJob(f"Job.kind: {self.unknown_kind_message(kind)}, or pass check_kinds=False")

    # -- database ----------------------------------------------------------------

    def driver(self, bind: Engine | Connection) -> Driver:
        """The database driver for this queue's tables on ``bind``'s database (internal: see sqla_jobs.drivers)."""
        key = type(bind.dialect)
        if key not in self._drivers:
            self._drivers[key] = driver_for(bind, self.job_model.__table__, self.dead_model.__table__)  # type: ignore[attr-defined]
        return self._drivers[key]

    def create_tables(self, engine: Engine) -> None:
        """Create the two tables (and their PostgreSQL schema) and their indexes if missing; for apps without alembic.

        Existing tables are not altered otherwise: a column added by a newer
        sqla-jobs needs a migration (see docs/howto/migrations.md).
        """
        with engine.begin() as conn:
            self.driver(conn).create(conn)
        self.driver(engine).prepare(engine)

    def check_schema(self, engine: Engine) -> None:
        with engine.connect() as conn:
            self.driver(conn).check_schema(conn)

    # -- admin, in the caller's transaction -----------------------------------------

    def enqueue(self, session: Session, kind: str, payload: dict[str, Any] | None = None, **fields: Any) -> J:
        """Add a job to ``session`` (same as ``session.add(Job(...))``) and return it."""
        job = self.job_model(kind=kind, payload={} if payload is None else payload, **fields)
        session.add(job)
        return job

    def enqueue_many(self, session: Session, jobs: Iterable[Mapping[str, Any]]) -> int:
        """Insert many jobs fast, in ``session``'s transaction; returns how many.

        Each item is a mapping with ``kind`` and optionally ``payload``,
        ``queue``, ``priority``, ``max_attempts`` and ``run_at``, checked
        exactly like ``Job(...)``: one bad item fails the call before anything
        is written. PostgreSQL loads them with COPY. No ORM objects are made,
        so ids are not returned; use ``session.add_all`` when you need them.
        """
        rows = []
        for item in jobs:
            row = check_row(self.job_model, item)
            self._check_kind_known(row["kind"])
            rows.append(row)
        session.flush()  # keep the order of jobs added earlier in this session
        conn = session.connection()
        self.driver(conn).insert_many(conn, rows)
        return len(rows)

    def requeue_dead(
        self, session: Session, *, ids: list[int] | None = None, kind: str | None = None, everything: bool = False
    ) -> list[int]:
        """Move dead jobs back to the jobs table: by ``ids``, by ``kind``, or ``everything``.

        Attempts restart at 0; the error history stays. Returns the ids moved.
        Raises NotFound when ``ids`` names a job that is not dead.
        """
        if ids is None and kind is None and not everything:
            raise ConfigError("requeue_dead needs ids=, kind= or everything=True")
        conn = session.connection()
        moved = self.driver(conn).requeue_dead(conn, ids=ids, kind=kind)
        if ids is not None:
            missing = sorted(set(ids) - set(moved))
            if missing:
                raise NotFound(f"no dead job with id {', '.join(map(str, missing))}")
        return moved

    # -- stats and operations (docs/howto/monitoring.md, docs/howto/operations.md) --------

    def stats(
        self, bind: Session | Engine | Connection, *, window: float = 3600.0, run_times: bool = True
    ) -> QueueStats:
        """Queue length, oldest pending age, dead letters and run times; see ``sqla_jobs._stats``."""
        with _connection(bind) as conn:
            return collect(self.driver(conn), conn, window, run_times=run_times)

    def get_job(self, session: Session, job_id: int) -> Any:
        """The job's row (all columns), or None. Reads the table, not the session's identity map."""
        conn = session.connection()
        return self.driver(conn).get_job(conn, job_id)

    def get_dead(self, session: Session, job_id: int) -> Any:
        """The dead job's row (all columns), or None."""
        conn = session.connection()
        return self.driver(conn).get_dead(conn, job_id)

    def list_jobs(
        self,
        session: Session,
        *,
        kind: str | None = None,
        state: str | None = None,
        queue: str | None = None,
        limit: int = 50,
    ) -> list[Any]:
        """Jobs newest first, filtered by kind / state / queue name."""
        if state is not None and state not in STATES:
            raise ConfigError(f"unknown state {state!r}; choose from {', '.join(STATES)}")
        conn = session.connection()
        return self.driver(conn).list_jobs(conn, kind=kind, state=state, queue=queue, limit=limit)

    def list_dead(
        self, session: Session, *, kind: str | None = None, since: float | None = None, limit: int = 50
    ) -> list[Any]:
        """Dead jobs, latest failure first; ``since``: only those that failed within that many seconds."""
        conn = session.connection()
        return self.driver(conn).list_dead(conn, kind=kind, since=since, limit=limit)

    def cancel(self, session: Session, job_id: int) -> str:
        """Cancel a job, in the caller's transaction.

        Returns ``"cancelled"`` for a pending job (it will never run) or
        ``"requested"`` for a running one: ``cancelled_at`` is recorded and
        honoured when the run ends. A run that then fails (even its last
        attempt), times out, snoozes or loses its worker ends ``cancelled``, with
        no retry or dead letter; a run that succeeds
        ends ``finished`` (its work is done and cannot be undone), and keeps
        ``cancelled_at`` as the record that the request came too late.
        Raises NotFound, or JobStateError for a finished or cancelled job.
        """
        conn = session.connection()
        changed, state = self.driver(conn).cancel(conn, job_id)
        if state is None:
            raise NotFound(self._not_found(conn, job_id))
        if not changed:
            raise JobStateError(f"job {job_id} is {state} already: there is nothing to cancel")
        return "cancelled" if state == "pending" else "requested"

    def retry_now(self, session: Session, job_id: int) -> None:
        """Make a pending job (a retry in backoff, a delayed job) due now, in the caller's transaction."""
        conn = session.connection()
        result = self.driver(conn).retry_now(conn, job_id)
        if result is None:
            raise NotFound(self._not_found(conn, job_id))
        if result != "pending":
            hint = " (it is running now)" if result == "running" else ""
            raise JobStateError(f"job {job_id} is {result}{hint}: only a pending job can be made due now")

    def purge_dead(self, session: Session, *, older_than: float, kind: str | None = None) -> int:
        """Delete dead jobs that failed more than ``older_than`` seconds ago; returns how many."""
        if older_than < 0:
            raise ConfigError("older_than must be >= 0 seconds")
        conn = session.connection()
        return self.driver(conn).purge_dead(conn, older_than, kind)

    def prune(
        self, engine: Engine, *, older_than: float, batch_size: int = 1000, max_batches: int | None = None
    ) -> int:
        """Delete finished and cancelled jobs whose ``finished_at`` is older than ``older_than`` seconds.

        Deletes ``batch_size`` rows per transaction, committing each, so it
        never holds many row locks or a long transaction on a busy table; stops
        after ``max_batches`` when given. Returns how many rows were deleted.
        On PostgreSQL, when another process is pruning the same table it
        returns at once (each batch takes a try-advisory lock).
        """
        if older_than < 0 or batch_size < 1:
            raise ConfigError("prune needs older_than >= 0 seconds and batch_size >= 1")
        driver = self.driver(engine)
        deleted = batches = 0
        while max_batches is None or batches < max_batches:
            with driver.write(engine) as conn:
                if not driver.prune_lock(conn):
                    break
                count = driver.prune_batch(conn, older_than, batch_size)
            deleted += count
            batches += 1
            if count < batch_size:
                break
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
        raise ConfigError(f"expected a Session, Engine or Connection, got {type(bind).__name__}")
