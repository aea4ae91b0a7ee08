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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session
from sqlalchemy.schema import CreateIndex

from .backoff import Backoff
from .errors import ConfigError, InvalidJob, NotFound
from .models import DeadJobMixin, JobMixin
from .sql import SQL

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
        self._sql: dict[str, SQL] = {}
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

    def sql(self, bind: Engine | Connection) -> SQL:
        name = bind.dialect.name
        if name not in self._sql:
            self._sql[name] = SQL(self.job_model.__table__, self.dead_model.__table__, name)  # type: ignore[attr-defined]
        return self._sql[name]

    def create_tables(self, engine: Engine) -> None:
        """Create the two tables (and their PostgreSQL schema) and their indexes if missing; for apps without alembic.

        Existing tables are not altered otherwise: a column added by a newer
        sqla-jobs needs a migration (see docs/howto/migrations.md).
        """
        tables = [self.job_model.__table__, self.dead_model.__table__]  # type: ignore[attr-defined]
        with engine.begin() as conn:
            for schema in {t.schema for t in tables if t.schema}:
                if engine.dialect.name == "postgresql":
                    conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
            for table in tables:
                table.create(conn, checkfirst=True)
                for index in table.indexes:  # tables made by an older sqla-jobs may lack an index added since
                    conn.execute(CreateIndex(index, if_not_exists=True))
        self.sql(engine).prepare(engine)

    def check_schema(self, engine: Engine) -> None:
        with engine.connect() as conn:
            self.sql(conn).check_schema(conn)

    # -- admin, in the caller's transaction -----------------------------------------

    def enqueue(self, session: Session, kind: str, payload: dict[str, Any] | None = None, **fields: Any) -> J:
        """Add a job to ``session`` (same as ``session.add(Job(...))``) and return it."""
        job = self.job_model(kind=kind, payload={} if payload is None else payload, **fields)
        session.add(job)
        return job

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
        moved = self.sql(conn).requeue_dead(conn, ids=ids, kind=kind)
        if ids is not None:
            missing = sorted(set(ids) - set(moved))
            if missing:
                raise NotFound(f"no dead job with id {', '.join(map(str, missing))}")
        return moved
