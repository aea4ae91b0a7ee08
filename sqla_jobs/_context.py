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
again.

``current_job().cancelled`` is an event set when the run should stop: someone
asked to cancel the job (``queue.cancel`` / ``sqla-jobs jobs cancel``; the worker
learns of it at its next heartbeat, and ``cancel_requested`` is then True) or
the worker gave up on the run (timeout, lost lease, shutdown). A sync handler
polls it or waits on it, or calls ``check_cancelled()``, which raises
``JobCancel``; an async handler also gets ``asyncio.CancelledError``. Once a
cancel request has reached the run, the job ends ``cancelled`` however the
handler then stops (docs/howto/cancelling.md).

``current_job().set_progress(value)`` records how far a long run got (any
small JSON value); the worker writes the latest value about once a second,
and ``sqla-jobs jobs show`` prints it.

``current_job().step(name, fn, *args)``, ``sleep(duration)``, ``sleep_until(when)`` and
``wait_for_event(key, timeout)`` make a durable job: its steps' values are kept, and a sleep or
a wait parks the job without holding a thread (``sqla_jobs._durable``, docs/howto/durable.md).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from . import _durable
from ._batch import BatchStatus, status_of
from ._payload import MAX_PROGRESS_BYTES, encode_value
from .errors import JobCancel

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
    _requested: bool = field(default=False, repr=False)
    # Where set_progress reports: the worker's dict of unwritten progress, keyed by this run's fence.
    _progress_sink: dict[Any, JobContext] | None = field(default=None, repr=False)
    _fence: Any = field(default=None, repr=False)
    _progress_limit: int = field(default=MAX_PROGRESS_BYTES, repr=False)
    progress: Any = None
    # What reads the job's graph and batch: the worker's executor (``read(statement)``, ``read_async``).
    _graph: Any = field(default=None, repr=False)
    # What keeps the job's steps (``sqla_jobs._durable.DurableStore``: ``sqla_jobs.worker.steps``), and this run's
    # view of them, read at its first step.
    _durable: Any = field(default=None, repr=False)
    _book: Any = field(default=None, repr=False)

    @property
    def cancelled(self) -> threading.Event:
        """Set when this run should stop: a cancel request reached it, or the worker gave up on it
        (timeout, lost lease, shutdown)."""
        # Made on first use: most handlers never look, and an Event per job costs.
        if self._cancelled is None:
            with _event_lock:  # the worker and the handler may both ask first
                if self._cancelled is None:
                    self._cancelled = threading.Event()
        return self._cancelled

    @property
    def cancel_requested(self) -> bool:
        """True once someone's cancel request (``queue.cancel``, ``jobs cancel``) reached this run."""
        return self._requested

    def check_cancelled(self) -> None:
        """Raise ``JobCancel`` if this run should stop (see ``cancelled``); a cheap call for loops."""
        if self._cancelled is not None and self._cancelled.is_set():
            raise JobCancel("cancel requested" if self._requested else "the worker gave up on this run")

    def set_progress(self, value: Any) -> None:
        """Record how far this run got: any JSON value up to ``max_progress_bytes`` (4 KiB), e.g.
        ``{"done": 40, "total": 100}``. Cheap to call often: the worker writes the latest value
        about once a second, and once more when the job finishes. Raises ``InvalidJob`` for a
        value JSON cannot store."""
        if value is None:
            raise ValueError("set_progress needs a value; None would not be written")
        # A snapshot: the handler may go on changing the object it passed.
        self.progress = json.loads(encode_value(value, self._progress_limit, "the progress value"))
        if self._progress_sink is not None:
            self._progress_sink[self._fence] = self

    def upstream_results(self) -> list[Any]:
        """What the jobs this one ``depends_on`` returned, in ``depends_on`` order (sqla_jobs._graph).

        None for an upstream that returned None, one that ran anyway's failed upstream (dead-lettered or
        cancelled), or one pruned since. One read of the database per call; from an ``async def``
        handler, ``await upstream_results_async()`` instead."""
        return [row.result for row in self._graph_reader().read(self._upstreams)]

    async def upstream_results_async(self) -> list[Any]:
        """``upstream_results()`` for an ``async def`` handler: the read does not block the event loop."""
        return [row.result for row in await self._graph_reader().read_async(self._upstreams)]

    def upstreams(self) -> list[Any]:
        """The jobs this one depends on, in ``depends_on`` order: rows of (``position``, ``id``, ``state``,
        ``result``, ``ended``); ``state`` is None for one no longer in the jobs table, ``ended`` says how a
        failed upstream ended (dead, cancelled, purged) when this job ran anyway."""
        return self._graph_reader().read(self._upstreams)  # type: ignore[no-any-return]

    def _upstreams(self, driver: Any, conn: Any) -> list[Any]:
        return driver.upstreams(conn, self.id)  # type: ignore[no-any-return]

    def batch(self) -> BatchStatus | None:
        """The batch this job is a callback or a member of, as it stands now (``sqla_jobs._batch``): its
        members' counts (``finished``, ``dead``, ``cancelled``, ``waiting``); None when it is in no batch.
        From an ``async def`` handler, ``await batch_async()``."""
        return self._graph_reader().read(self._batch)  # type: ignore[no-any-return]

    async def batch_async(self) -> BatchStatus | None:
        """``batch()`` for an ``async def`` handler."""
        return await self._graph_reader().read_async(self._batch)  # type: ignore[no-any-return]

    def _batch(self, driver: Any, conn: Any) -> BatchStatus | None:
        return status_of(driver, conn, driver.batch_of(conn, self.id))

    def _graph_reader(self) -> Any:
        if self._graph is None:
            raise LookupError("upstream_results() and batch() need a job run by a sqla-jobs worker")
        return self._graph

    # -- durable jobs (sqla_jobs._durable) -------------------------------------------------------

    def step(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` once per job: its value (checked like a result) is stored under ``name``, and a
        re-run of the job returns the stored copy without calling ``fn``. In a transactional handler the value
        commits with the handler's writes."""
        return _durable.step(self, name, fn, args, kwargs)

    async def step_async(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``step`` for an ``async def`` handler: ``fn`` may be a coroutine function."""
        return await _durable.step_async(self, name, fn, args, kwargs)

    def sleep(self, duration: timedelta | float, *, name: str | None = None) -> None:
        """Park the job for ``duration`` (a timedelta or seconds): this run ends here, holding no thread or
        connection, and the job runs again from the top at the due time, passing this sleep."""
        _durable.sleep(self, duration, name)

    async def sleep_async(self, duration: timedelta | float, *, name: str | None = None) -> None:
        await _durable.sleep_async(self, duration, name)

    def sleep_until(self, when: datetime, *, name: str | None = None) -> None:
        """``sleep`` until ``when`` (a time-zone aware datetime; a naive one is taken as UTC)."""
        _durable.sleep_until(self, when, name)

    async def sleep_until_async(self, when: datetime, *, name: str | None = None) -> None:
        await _durable.sleep_until_async(self, when, name)

    def wait_for_event(self, key: str, timeout: timedelta | float, *, name: str | None = None) -> Any:
        """The data of event ``key`` (``queue.emit_event``), at once if it was emitted already; else the job
        parks until it is emitted, or ``timeout`` passes and this returns None."""
        return _durable.wait_for_event(self, key, timeout, name)

    async def wait_for_event_async(self, key: str, timeout: timedelta | float, *, name: str | None = None) -> Any:
        return await _durable.wait_for_event_async(self, key, timeout, name)

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
