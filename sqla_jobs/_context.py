"""What a running handler can learn about its job, without changing its signature.

A handler is called as ``handler(payload)``. Inside it::

    from sqla_jobs import current_job

    @queue.handler("export")
    def export(payload):
        job = current_job()
        log.info("export %s, attempt %d of %d", job.id, job.attempt, job.max_attempts)

For handlers registered with ``transactional=True``, ``current_job().session``
is a Session whose writes commit in the same transaction that marks the job
finished: if the worker crashes first, none of them happened and the job runs
again. ``current_job().cancelled`` is set when the worker gives up on the run
(timeout, shutdown): long handlers may check it and stop early.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

__all__ = ["JobContext", "current_job"]


@dataclass
class JobContext:
    """The job a handler is running."""

    id: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    payload: dict[str, Any]
    worker: str
    session: Session | None = None
    _cancelled: threading.Event | None = field(default=None, repr=False)

    @property
    def cancelled(self) -> threading.Event:
        """Set when the worker has given up on this run (timeout, lost lease, shutdown)."""
        # Made on first use: most handlers never look, and an Event per job costs.
        if self._cancelled is None:
            with _event_lock:  # the worker and the handler may both ask first
                if self._cancelled is None:
                    self._cancelled = threading.Event()
        return self._cancelled

    @property
    def last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts


_event_lock = threading.Lock()
_current: ContextVar[JobContext | None] = ContextVar("sqla_jobs_current_job", default=None)


def current_job() -> JobContext:
    """The job being run by this handler; raises LookupError outside a handler."""
    ctx = _current.get()
    if ctx is None:
        raise LookupError("current_job() is only available inside a job handler")
    return ctx
