"""The app's operations on durable jobs (a mixin of ``Admin``): emit an event, read a job's steps.

``queue.emit_event(session, key, data)`` is the business side of ``current_job().wait_for_event``
(sqla_jobs._durable): it runs in the caller's transaction, so the event exists, and the jobs
waiting for it become due, exactly when that transaction commits; a rollback leaves no trace.
``queue.emit_events(session, {key: data, ...})`` is the same for many events in a few statements.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from . import _durable

if TYPE_CHECKING:
    from .drivers import Driver

__all__ = ["DurableAdmin"]


class DurableAdmin:
    """``emit_event``, ``emit_events``, ``job_steps``, ``get_event``, ``waiting_for`` (``queue.aio`` has each as a
    coroutine)."""

    job_model: Any
    tracing: Any  # the registry's: None, or what sqla_jobs.otel.instrument set

    if TYPE_CHECKING:  # provided by JobQueue (sqla_jobs._app)
        def driver(self, bind: Engine | Connection) -> Driver: ...

    def emit_event(self, session: Session, key: str, data: Any = None) -> int | None:
        """Emit event ``key`` with ``data`` (any JSON value, checked like a result) in the caller's transaction.

        Jobs parked in ``wait_for_event(key, ...)`` become due when the transaction commits (PostgreSQL
        wakes listening workers then; other backends' workers find them at their next poll), and later
        waits for ``key`` return ``data`` at once. The first emit of a key wins: returns None when ``key``
        was emitted before (nothing changes), else how many parked jobs this emit makes due. Raises
        InvalidJob for a key that is not a string of 1 to 255 characters, or data JSON cannot store.
        Nothing is written if the transaction rolls back.
        """
        won, woken = self._emit(session, [(key, data)], key)
        return woken if won else None

    def emit_events(self, session: Session, events: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> int:
        """``emit_event`` for many events at once, in the caller's transaction: ``events`` maps each key to its
        data (or is an iterable of ``(key, data)`` pairs). The same as ``emit_event`` of each in turn (the first
        emit of a key wins, here too: a key given twice keeps its first data), in a few statements whatever the
        number of events (on SQLite and MariaDB, one round of them per 5,000 events). Every key and data is
        checked first (InvalidJob, as ``emit_event``), so a bad one writes nothing. Returns how many parked jobs
        the events made due."""
        return self._emit(session, events, None)[1]

    def _emit(self, session: Session, events: Mapping[str, Any] | Iterable[tuple[str, Any]],
              key: str | None) -> tuple[set[str], int]:
        """The keys emitted and the jobs woken; a span in the caller's trace when traced (``emit <key>`` for one
        event, ``emit <n> events`` for several)."""
        conn = session.connection()
        limit = self.job_model.max_result_bytes
        if self.tracing is None:
            return _durable.emit_events(self.driver(conn), conn, events, limit)
        pairs = list(events.items()) if isinstance(events, Mapping) else list(events)
        with self.tracing.emit(key, len(pairs)) as span:  # sqla_jobs.otel
            won, woken = _durable.emit_events(self.driver(conn), conn, pairs, limit)
            span.set_attribute("sqla_jobs.event.woken", woken if won or key is None else -1)
            return won, woken

    def get_event(self, session: Session, key: str) -> Any:
        """The emitted event ``key`` (``data``, ``emitted_at``), or None if it was not emitted (or was pruned)."""
        conn = session.connection()
        return self.driver(conn).event(conn, _durable.check_key(key))

    def waiting_for(self, session: Session, key: str) -> list[int]:
        """The ids of the jobs parked waiting for event ``key``."""
        conn = session.connection()
        return self.driver(conn).waiting_for(conn, _durable.check_key(key))

    def job_steps(self, session: Session, job_id: int) -> list[Any]:
        """A job's steps, sleeps and waits as stored, in the order they started: rows of (``name``, ``value``,
        ``until``: a sleep's due time or a wait's deadline, ``awaiting``: the event key a parked wait waits
        for, ``started_at``, ``finished_at``: None while the sleep or wait has not been passed)."""
        conn = session.connection()
        return self.driver(conn).job_steps(conn, job_id)
