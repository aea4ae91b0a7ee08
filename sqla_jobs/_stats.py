"""The four figures that tell whether an app's queues are healthy, from ``queue.stats(engine)``.

::

    s = queue.stats(engine)                  # or a Session / Connection
    s.ready, s.scheduled, s.running          # queue length
    s.blocked                                # waiting for the jobs they depend on (job graphs)
    s.oldest_pending_age                     # seconds the oldest due job has waited (None: none due)
    s.dead_by_kind.get("send_email")         # dead letters by kind (None: that kind has none)
    s.retrying.get("send_email", 0)          # failed at least once, waiting for the next attempt
    s.run_time_by_kind.get("send_email")     # run time by kind over the window (None: none finished)
    s.throughput                             # jobs finished per minute over the window

1. **Queue length**, split into *ready* (due now, waiting for a worker),
   *scheduled* (``run_at`` in the future: retries in backoff, delayed jobs)
   and *running*; also per queue name in ``s.queues``. Beside them,
   ``blocked``: jobs waiting for the jobs they depend on (``depends_on``),
   which no worker may take yet.
2. **Oldest pending age**: how long the longest-waiting *due* job has waited,
   counted from when it became due (``now - run_at``, database clock), so a
   job scheduled for tomorrow does not count as late today. The most useful
   alarm: a ready job that has waited many minutes means workers are down,
   stuck or too few.
3. **Dead letters by kind**: jobs that used up their attempts, in total and
   within the window. Beside them, ``retrying``: pending jobs of each kind
   that have failed at least once and wait for their next attempt, the
   failures still in flight (a kind whose count keeps growing is failing
   now and will feed the dead letters next).
4. **Run time by kind** over the window (default one hour): count, mean,
   p50, p95 and max of ``finished_at - locked_at`` for jobs that finished in
   it. A p95 that grows comes before timeouts and failures. This is the time
   from claim to recorded finish: the handler's own time (what the worker's
   log line shows in parentheses, and the metrics' run histogram) plus the
   claim's commit, any wait for a free handler thread and the batched write
   of the finish, a few milliseconds per job (more on SQLite, where each
   commit waits for the disk). So a 0.1 ms handler shows as ~10 ms here.

Every figure comes from the database, so it is the same whichever process
asks. The queries use the table's partial indexes (pending, running,
finished_at) and read neither old finished rows nor payloads; see
docs/howto/monitoring.md for the measured cost on a million-row table.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Connection

from ._durations import format_duration
from .drivers.base import Driver, percentile
from .errors import ConfigError

__all__ = ["COUNTED", "COUNTERS", "DeadLetters", "QueueLength", "QueueStats", "RunTime", "cached_stats", "collect",
           "open_transaction_age", "percentile", "stats_tables"]

log = logging.getLogger("sqla_jobs")

#: The job counters both exporters keep (``sqla_jobs.metrics``, ``sqla_jobs.otel``): name -> help text ...
COUNTERS = {
    "finished": "Job runs that finished successfully.",
    "failed": "Job runs that failed (then retried or dead-lettered).",
    "retried": "Failed job runs that were scheduled for another attempt.",
    "dead_lettered": "Jobs moved to the dead-letter table after their last attempt.",
    "cancelled": "Jobs that ended cancelled.",
    "lost": "Job results discarded because the worker lost its claim.",
}
#: ... and which of them each hook event counts.
COUNTED = {
    "finished": ("finished",),
    "failed": ("failed", "retried"),
    "dead_letter": ("failed", "dead_lettered"),
    "cancelled": ("cancelled",),
    "lost": ("lost",),
}

DEFAULT_WINDOW = 3600.0


@dataclass(frozen=True)
class QueueLength:
    """Jobs of one queue name by state; ``expired_leases`` counts running jobs whose worker looks gone."""

    queue: str
    ready: int = 0
    scheduled: int = 0
    running: int = 0
    expired_leases: int = 0
    oldest_pending_age: float | None = None
    #: Jobs waiting for the jobs they depend on (``state = 'blocked'``).
    blocked: int = 0


@dataclass(frozen=True)
class DeadLetters:
    """Dead jobs of one kind: all of them, and those that died within the window."""

    kind: str
    total: int
    recent: int


@dataclass(frozen=True)
class RunTime:
    """Run times (seconds) of the jobs of one kind that finished within the window."""

    kind: str
    count: int
    mean: float
    p50: float
    p95: float
    max: float
    per_minute: float


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of one jobs table; see the module docstring."""

    window: float
    ready: int
    scheduled: int
    running: int
    oldest_pending_age: float | None
    finished: int
    throughput: float
    queues: list[QueueLength] = field(default_factory=list)
    dead: list[DeadLetters] = field(default_factory=list)
    run_times: list[RunTime] = field(default_factory=list)
    #: Pending jobs that have failed at least once, by kind (kinds with none are absent).
    retrying: dict[str, int] = field(default_factory=dict)
    #: Jobs waiting for the jobs they depend on (``state = 'blocked'``; job graphs).
    blocked: int = 0

    @property
    def retrying_total(self) -> int:
        return sum(self.retrying.values())

    @property
    def dead_total(self) -> int:
        return sum(d.total for d in self.dead)

    @property
    def dead_by_kind(self) -> dict[str, DeadLetters]:
        return {d.kind: d for d in self.dead}

    @property
    def run_time_by_kind(self) -> dict[str, RunTime]:
        return {r.kind: r for r in self.run_times}

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (what ``sqla-jobs stats --json`` prints)."""
        data = asdict(self)
        data["dead_total"] = self.dead_total
        data["retrying_total"] = self.retrying_total
        return data


def collect(driver: Driver, conn: Connection, window: float = DEFAULT_WINDOW, *, run_times: bool = True) -> QueueStats:
    """Read the figures in one read-only pass. ``run_times=False`` skips the window's run
    times and throughput (what a frequent Prometheus scrape needs is only the cheap counts)."""
    if window <= 0:
        raise ConfigError(f"the stats window must be > 0 seconds, got {window:g}")
    per_queue: dict[str, dict[str, Any]] = defaultdict(dict)
    for row in driver.pending_by_queue(conn):
        age = None if row.oldest_age is None else max(0.0, float(row.oldest_age))
        per_queue[row.queue].update(ready=row.ready, scheduled=row.scheduled, oldest_pending_age=age)
    for row in driver.running_by_queue(conn):
        per_queue[row.queue].update(running=row.running, expired_leases=row.expired)
    for row in driver.blocked_by_queue(conn):
        per_queue[row.queue].update(blocked=row.blocked)
    queues = [QueueLength(name, **figures) for name, figures in sorted(per_queue.items())]
    ages = [q.oldest_pending_age for q in queues if q.oldest_pending_age is not None]
    dead = [DeadLetters(r.kind, r.total, r.recent) for r in driver.dead_by_kind(conn, window)]
    times = _run_times(driver, conn, window) if run_times else []
    finished = sum(r.count for r in times)
    return QueueStats(
        window=window,
        ready=sum(q.ready for q in queues),
        scheduled=sum(q.scheduled for q in queues),
        running=sum(q.running for q in queues),
        oldest_pending_age=max(ages) if ages else None,
        finished=finished,
        throughput=finished / (window / 60.0),
        queues=queues,
        dead=dead,
        run_times=times,
        retrying={r.kind: r.retrying for r in driver.retrying_by_kind(conn)},
        blocked=sum(q.blocked for q in queues),
    )


def _run_times(driver: Driver, conn: Connection, window: float) -> list[RunTime]:
    minutes = window / 60.0
    return [RunTime(kind, count, mean, p50, p95, top, count / minutes)
            for kind, count, mean, p50, p95, top in driver.run_times(conn, window)]


def stats_tables(s: QueueStats) -> list[tuple[str, list[str], list[list[str]]]]:
    """The snapshot as (title, headers, rows) tables, for the CLI's rich or plain output."""
    window = format_duration(s.window)
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    headline = [
        ["ready", str(s.ready)],
        ["scheduled", str(s.scheduled)],
        ["running", str(s.running)],
        ["blocked", str(s.blocked)],
        ["oldest pending age", format_duration(s.oldest_pending_age)],
        ["waiting for a retry", str(s.retrying_total)],
        ["dead letters", f"{s.dead_total} ({sum(d.recent for d in s.dead)} in the last {window})"],
        [f"finished (last {window})", f"{s.finished} ({_rate(s.throughput)}/min)"],
    ]
    tables.append(("Queue health", ["figure", "value"], headline))
    if len(s.queues) > 1 or any(q.expired_leases for q in s.queues):
        tables.append((
            "By queue",
            ["queue", "ready", "scheduled", "running", "blocked", "expired leases", "oldest pending"],
            [[q.queue, str(q.ready), str(q.scheduled), str(q.running), str(q.blocked), str(q.expired_leases),
              format_duration(q.oldest_pending_age)] for q in s.queues],
        ))
    if s.run_times:
        tables.append((
            f"Run time by kind (claim to finish, last {window})",
            ["kind", "count", "per min", "mean", "p50", "p95", "max"],
            [[r.kind, str(r.count), _rate(r.per_minute), format_duration(r.mean), format_duration(r.p50),
              format_duration(r.p95), format_duration(r.max)] for r in s.run_times],
        ))
    if s.retrying:
        tables.append((
            "Retrying by kind",
            ["kind", "failed, waiting for a retry"],
            [[kind, str(n)] for kind, n in sorted(s.retrying.items())],
        ))
    if s.dead:
        tables.append((
            "Dead letters by kind",
            ["kind", "total", f"last {window}"],
            [[d.kind, str(d.total), str(d.recent)] for d in s.dead],
        ))
    return tables


def _rate(per_minute: float) -> str:
    return f"{per_minute:.2f}" if per_minute < 10 else f"{per_minute:.0f}"


def cached_stats(gauges: Any) -> QueueStats | None:
    """``gauges.queue.stats(gauges.engine, run_times=False)``, at most ``gauges.stats_max_age`` seconds old, kept
    in ``gauges._cached`` (the Prometheus exporter's and the OpenTelemetry meter's gauges); None if the database
    did not answer: a collection must not crash the worker, the gauges just go missing."""
    return _fresh(gauges, "_cached", "the stats", lambda: gauges.queue.stats(gauges.engine, run_times=False))


def open_transaction_age(gauges: Any) -> float | None:
    """Seconds the oldest transaction open in the database has been open (0.0: none), kept as ``cached_stats``
    keeps its figures, in ``gauges._open_cached``. None where the backend keeps no old row versions for it to
    hold back (SQLite), or if the database did not answer (``drivers/_transactions.py`` says why it matters)."""

    def read() -> float | None:
        with gauges.engine.connect() as conn:
            driver = gauges.queue.driver(conn)
            if not driver.keeps_old_versions:
                return None
            found = driver.oldest_transaction(conn)
            return found.seconds if found else 0.0

    return _fresh(gauges, "_open_cached", "the oldest open transaction", read)  # type: ignore[no-any-return]


def _fresh(gauges: Any, slot: str, what: str, read: Any) -> Any:
    """What ``read()`` returns, at most ``gauges.stats_max_age`` seconds old, kept in ``gauges.<slot>`` under
    ``gauges._lock``; None (and a warning) if it raised."""
    assert gauges.engine is not None
    with gauges._lock:
        at, cached = getattr(gauges, slot)
        if time.monotonic() - at < gauges.stats_max_age:
            return cached
        try:
            cached = read()
        except Exception as exc:
            log.warning("metrics: could not read %s: %s", what, str(exc).splitlines()[0])
            cached = None
        setattr(gauges, slot, (time.monotonic(), cached))
        return cached
