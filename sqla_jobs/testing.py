"""Helpers for your own test suite: run jobs inline, assert what was enqueued, make jobs due now.

::

    from sqla_jobs.testing import assert_enqueued, eager, make_due, run_due

    with Session(engine) as session, session.begin():
        signup(session, "a@example.com")          # your code, which enqueues
        assert_enqueued(session, queue, "send_email", {"to": "a@example.com"})

    report = run_due(engine, queue)               # the real worker, in burst mode
    assert [e.kind for e in report.finished] == ["send_email"]

    make_due(engine, queue)                       # retries in backoff and delayed jobs: due now
    with eager(queue):                            # unit tests: each commit runs its jobs at once
        ...

Everything here runs the code production runs: ``run_due`` is
``Worker(...).run(burst=True)`` and learns what happened from the queue's
hooks; ``make_due`` moves ``run_at`` with the database's clock (the one the
worker schedules with, which Python time-freezing tools cannot reach). See
docs/howto/testing.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.orm import Session

from ._app import EVENTS, JobEvent, JobQueue
from .errors import ConfigError
from .worker.worker import Worker

__all__ = ["JobsFailed", "RunReport", "assert_enqueued", "eager", "make_due", "run_due"]

#: ``make_due`` and ``assert_enqueued`` look at this many jobs at most: plenty for a test's database.
_SCAN_LIMIT = 100_000


class JobsFailed(AssertionError):
    """Jobs failed or were dead-lettered where a test expected them to succeed; the message lists each error."""


@dataclass
class RunReport:
    """What one ``run_due`` (or one eager commit) did, as the worker reported it through the hooks."""

    events: list[JobEvent] = field(default_factory=list)

    def _named(self, name: str) -> list[JobEvent]:
        return [e for e in self.events if e.name == name]

    @property
    def finished(self) -> list[JobEvent]:
        return self._named("finished")

    @property
    def failed(self) -> list[JobEvent]:
        """Runs that failed and were scheduled for another attempt."""
        return self._named("failed")

    @property
    def dead(self) -> list[JobEvent]:
        """Jobs that used up their attempts and moved to the dead-letter table."""
        return self._named("dead_letter")

    @property
    def cancelled(self) -> list[JobEvent]:
        return self._named("cancelled")

    @property
    def snoozed(self) -> list[JobEvent]:
        return self._named("snoozed")

    @property
    def lost(self) -> list[JobEvent]:
        """Runs whose result was discarded because the worker lost its claim."""
        return self._named("lost")

    @property
    def errors(self) -> list[str]:
        """The error of every failed run and dead-lettered job, in order."""
        return [e.error or "" for e in self.events if e.name in ("failed", "dead_letter")]

    def raise_errors(self) -> RunReport:
        """Raise ``JobsFailed`` if any run failed or any job was dead-lettered; else return self."""
        bad = [e for e in self.events if e.name in ("failed", "dead_letter", "lost")]
        if bad:
            lines = [f"  job {e.id} {e.kind!r} attempt {e.attempt}: {e.name}: {e.error or ''}".rstrip() for e in bad]
            raise JobsFailed(f"{len(bad)} job run(s) did not succeed:\n" + "\n".join(lines))
        return self


def run_due(engine: Engine, queue: JobQueue[Any, Any], *, concurrency: int = 1, **worker_options: Any) -> RunReport:
    """Run every due job with a real worker in this process until none is due; report what happened.

    A failing job whose retry is due at once (a zero backoff) runs again in the same call; one in
    backoff does not: call ``make_due`` and ``run_due`` again. The report is built from the queue's
    hooks, so do not run another worker of the same queue in this process at the same time.
    """
    report = RunReport()
    lock = threading.Lock()

    def record(ev: JobEvent) -> None:
        with lock:
            report.events.append(ev)

    names = [name for name in EVENTS if name != "started"]
    for name in names:
        queue.on(name)(record)
    try:
        worker_options.setdefault("poll_interval", 0.05)
        worker_options.setdefault("listen", False)  # a burst needs no wake-ups
        Worker(engine, queue, concurrency=concurrency, **worker_options).run(burst=True, install_signals=False)
    finally:
        for name in names:
            queue.off(name, record)
    return report


def make_due(bind: Engine | Connection | Session, queue: JobQueue[Any, Any], *, kind: str | None = None) -> int:
    """Make every pending job scheduled for later (delayed jobs, retries in backoff) due now; returns how many.

    A durable job parked in a sleep or a wait (docs/howto/durable.md) has it end now: its next run passes
    the sleep, and the wait returns None as if it had timed out. Uses the database's clock, as the worker
    does. With a Session or Connection the change is part of its transaction (commit it); with an Engine
    it commits at once.
    """
    if isinstance(bind, Session):
        return _make_due(queue, bind.connection(), kind)
    if isinstance(bind, Connection):
        return _make_due(queue, bind, kind)
    with bind.begin() as conn:
        return _make_due(queue, conn, kind)


def _make_due(queue: JobQueue[Any, Any], conn: Connection, kind: str | None) -> int:
    driver = queue.driver(conn)
    driver.end_parks(conn, kind, datetime.now(timezone.utc))  # first: it finds the parked jobs by their run_at
    return driver.make_due(conn, kind)


def _matches(payload: Any, expected: Mapping[str, Any] | Callable[[Any], bool] | None) -> bool:
    if expected is None:
        return True
    if callable(expected):
        return bool(expected(payload))
    return isinstance(payload, Mapping) and all(k in payload and payload[k] == v for k, v in expected.items())


def assert_enqueued(
    bind: Session | Engine | Connection,
    queue: JobQueue[Any, Any],
    kind: str,
    payload: Mapping[str, Any] | Callable[[Any], bool] | None = None,
    *,
    count: int | None = None,
    state: str | None = None,
) -> list[Any]:
    """Assert that a job of ``kind`` whose payload matches was enqueued; return the matching jobs.

    ``payload``: a dict (each of its keys must be in the job's payload with an equal value; other
    keys may be there too) or a predicate ``fn(payload) -> bool``. ``count``: exactly that many
    must match (``count=0`` asserts that none was enqueued). ``state``: only jobs in that state.
    With a Session, jobs added to it and not flushed yet count too, and so does everything its
    transaction can see; with an Engine or Connection, what the table holds.
    """
    found: list[Any] = []
    if isinstance(bind, Session):
        found = [o for o in bind.new if isinstance(o, queue.job_model) and (state in (None, "pending"))]
        found += queue.list_jobs(bind, kind=kind, state=state, limit=_SCAN_LIMIT)
    elif isinstance(bind, Connection):
        with Session(bind=bind) as session:
            found = queue.list_jobs(session, kind=kind, state=state, limit=_SCAN_LIMIT)
    else:
        with Session(bind) as session:
            found = queue.list_jobs(session, kind=kind, state=state, limit=_SCAN_LIMIT)
    of_kind = [j for j in found if j.kind == kind]
    matching = [j for j in of_kind if _matches(j.payload, payload)]
    if (count is None and not matching) or (count is not None and len(matching) != count):
        wanted = "no" if count == 0 else (f"exactly {count}" if count is not None else "a")
        seen = "\n".join(f"  {j.kind!r} {j.payload!r}" for j in of_kind[:20]) or "  (no job of that kind)"
        raise AssertionError(
            f"expected {wanted} {kind!r} job matching {payload!r}, found {len(matching)}; jobs of that kind:\n{seen}"
        )
    return matching


class _Eager:
    """The session listeners behind ``eager``: collect jobs at flush, run them after commit."""

    KEY = "sqla_jobs_eager"

    def __init__(self, queue: JobQueue[Any, Any], engine: Engine | None, raise_errors: bool) -> None:
        self.queue = queue
        self.engine = engine
        self.raise_errors = raise_errors
        self.reports: list[RunReport] = []
        self.running = False  # handlers that commit jobs run inside our burst: it picks those up itself

    def after_flush(self, session: Session, _context: Any) -> None:
        added = [o for o in session.new if isinstance(o, self.queue.job_model)]
        if added:
            session.info.setdefault(self.KEY, []).extend(added)

    def after_rollback(self, session: Session) -> None:
        session.info.pop(self.KEY, None)

    def after_commit(self, session: Session) -> None:
        if not session.info.pop(self.KEY, None) or self.running:
            return
        engine = self.engine or session.get_bind(self.queue.job_model)
        if not isinstance(engine, Engine):
            raise ConfigError("eager(queue) found a session bound to a Connection: pass eager(queue, engine=...)")
        self.running = True
        try:
            report = run_due(engine, self.queue)
        finally:
            self.running = False
        self.reports.append(report)
        if self.raise_errors:
            report.raise_errors()


@contextmanager
def eager(
    queue: JobQueue[Any, Any], *, engine: Engine | None = None, raise_errors: bool = True
) -> Iterator[list[RunReport]]:
    """For unit tests only: while inside, a commit that added jobs of ``queue`` runs the due jobs at once.

    After a ``Session`` (any session of this process) commits a transaction in which it flushed new
    jobs, ``run_due`` runs on the session's engine (or ``engine``), so ``session.commit()`` returns
    after the handlers ran, and raises ``JobsFailed`` when one failed (``raise_errors=False``: it does
    not). Yields the list of ``RunReport``, one per such commit. Not promised: that only this
    commit's jobs run (every due job does), jobs from ``enqueue_many`` (no ORM objects: call
    ``run_due``), or anything about timing, concurrency or crashes: production runs a worker.
    """
    hooks = _Eager(queue, engine, raise_errors)
    listeners = [("after_flush", hooks.after_flush), ("after_rollback", hooks.after_rollback),
                 ("after_commit", hooks.after_commit)]
    for name, fn in listeners:
        event.listen(Session, name, fn)
    try:
        yield hooks.reports
    finally:
        for name, fn in listeners:
            event.remove(Session, name, fn)
