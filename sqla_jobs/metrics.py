"""Prometheus metrics for an app (its jobs and queues): ``pip install "sqla-jobs[prometheus]"``.

From the command line::

    sqla-jobs worker --app myapp.jobs:queue --metrics-port 9100

From Python::

    from sqla_jobs.metrics import QueueMetrics

    metrics = QueueMetrics(queue, engine)   # registers hooks and collectors
    metrics.serve(9100)                     # or expose prometheus_client.REGISTRY your own way
    Worker(engine, queue).run()

What is exported (``kind`` and ``queue`` are labels):

==========================================  =========  =============================================
``sqla_jobs_jobs_finished_total``           counter    runs that finished, by kind
``sqla_jobs_jobs_failed_total``             counter    runs that failed (retried or dead-lettered)
``sqla_jobs_jobs_retried_total``            counter    failed runs that were scheduled for a retry
``sqla_jobs_jobs_dead_lettered_total``      counter    jobs moved to the dead-letter table
``sqla_jobs_jobs_cancelled_total``          counter    jobs that ended cancelled
``sqla_jobs_jobs_lost_total``               counter    results discarded because the claim was lost
``sqla_jobs_job_run_seconds``               histogram  run time of finished and failed runs, by kind
``sqla_jobs_queue_length``                  gauge      jobs by queue and state (ready/scheduled/running/blocked)
``sqla_jobs_oldest_pending_age_seconds``    gauge      wait of the oldest due job, by queue (0: none)
``sqla_jobs_dead_jobs``                     gauge      jobs in the dead-letter table, by kind
``sqla_jobs_retrying_jobs``                 gauge      pending jobs that failed before, by kind
``sqla_jobs_oldest_transaction_seconds``    gauge      the oldest transaction open in the database (0:
                                                       none); PostgreSQL and MariaDB only: while one is
                                                       open, old row versions stay and claims slow down
==========================================  =========  =============================================

The counters and the histogram count what *this process* did (fed by the
``queue.on(...)`` hooks); sum them across workers in PromQL. The gauges
describe the whole table, so every worker exports the same values: use
``max()`` over them. They are read from the database when Prometheus scrapes,
at most once per ``stats_max_age`` seconds (default 5), with the cheap count
queries only (no run-time window), so scraping costs a few index reads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine

from ._app import JobEvent, JobQueue
from ._stats import COUNTED, COUNTERS, QueueLength, QueueStats, cached_stats, open_transaction_age
from .errors import ConfigError

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, start_http_server
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # pragma: no cover - exercised in a subprocess by the tests
    raise ConfigError(
        "Prometheus metrics need the prometheus-client package: pip install \"sqla-jobs[prometheus]\""
    ) from None

__all__ = ["RUN_TIME_BUCKETS", "QueueMetrics"]

log = logging.getLogger("sqla_jobs.metrics")

#: Seconds; from a fast handler (5 ms) to a slow batch job (30 min).
RUN_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)



class QueueMetrics:
    """Counters and a run-time histogram fed by ``queue``'s hooks, plus table gauges read via ``engine``.

    Pass ``engine=None`` to export only the counters and histogram.
    ``registry`` defaults to prometheus_client's global one.
    """

    def __init__(
        self,
        queue: JobQueue[Any, Any],
        engine: Engine | None = None,
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "sqla_jobs",
        stats_max_age: float = 5.0,
    ) -> None:
        self.queue = queue
        self.engine = engine
        self.registry = REGISTRY if registry is None else registry
        self.stats_max_age = stats_max_age
        self._counters: dict[str, Counter] = {
            name: Counter(f"jobs_{name}", help_text, ["kind"], namespace=namespace, registry=self.registry)
            for name, help_text in COUNTERS.items()
        }
        self.run_seconds = Histogram(
            "job_run_seconds", "Run time of job runs, by kind (finished and failed runs).", ["kind"],
            namespace=namespace, registry=self.registry, buckets=RUN_TIME_BUCKETS,
        )
        for event in COUNTED:
            queue.on(event)(self._on_event)
        self._lock = threading.Lock()
        self._cached: tuple[float, QueueStats | None] = (-1e9, None)
        self._open_cached: tuple[float, float | None] = (-1e9, None)
        self._collectors: list[Collector] = []
        if engine is not None:
            self._collectors.append(_TableCollector(self, namespace))
            self.registry.register(self._collectors[0])

    def detach(self) -> None:
        """Stop counting this app's events and drop the collectors from the registry."""
        for event in COUNTED:
            self.queue.off(event, self._on_event)
        for collector in (*self._counters.values(), self.run_seconds, *self._collectors):
            self.registry.unregister(collector)
        self._collectors = []

    def _on_event(self, event: JobEvent) -> None:
        for name in COUNTED[event.name]:
            self._counters[name].labels(event.kind).inc()
        if event.duration is not None and event.name in ("finished", "failed", "dead_letter"):
            self.run_seconds.labels(event.kind).observe(event.duration)

    def table_stats(self) -> QueueStats | None:
        """The cheap figures, at most ``stats_max_age`` seconds old; None if the database did not answer."""
        return cached_stats(self)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread."""
        start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics: serving Prometheus metrics on %s:%d/metrics", addr, port)


class _TableCollector(Collector):
    def __init__(self, metrics: QueueMetrics, namespace: str) -> None:
        self.metrics = metrics
        self.prefix = f"{namespace}_"
        # A queue that empties (or a kind whose dead jobs are purged) keeps reporting 0
        # rather than vanishing, so graphs drop to zero and alerts see the recovery.
        self.seen_queues: set[str] = {"default"}
        self.seen_dead_kinds: set[str] = set()
        self.seen_retrying_kinds: set[str] = set()

    def describe(self) -> list[Any]:
        return []  # the families depend on the data; don't query the database at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.metrics.table_stats()
        if stats is None:
            return
        length = GaugeMetricFamily(f"{self.prefix}queue_length", "Jobs in the table by queue and state.",
                                   labels=["queue", "state"])
        age = GaugeMetricFamily(f"{self.prefix}oldest_pending_age_seconds",
                                "Seconds the oldest due (ready) job has waited, by queue; 0 when none is due.",
                                labels=["queue"])
        queues = {q.queue: q for q in stats.queues}
        self.seen_queues.update(queues)
        for name in sorted(self.seen_queues):
            q = queues.get(name, QueueLength(name))
            length.add_metric([name, "ready"], q.ready)
            length.add_metric([name, "scheduled"], q.scheduled)
            length.add_metric([name, "running"], q.running)
            length.add_metric([name, "blocked"], q.blocked)
            age.add_metric([name], q.oldest_pending_age or 0.0)
        dead = GaugeMetricFamily(f"{self.prefix}dead_jobs", "Jobs in the dead-letter table, by kind.",
                                 labels=["kind"])
        totals = {d.kind: d.total for d in stats.dead}
        self.seen_dead_kinds.update(totals)
        for kind in sorted(self.seen_dead_kinds):
            dead.add_metric([kind], totals.get(kind, 0))
        retrying = GaugeMetricFamily(f"{self.prefix}retrying_jobs",
                                     "Pending jobs that failed at least once (waiting for a retry), by kind.",
                                     labels=["kind"])
        self.seen_retrying_kinds.update(stats.retrying)
        for kind in sorted(self.seen_retrying_kinds):
            retrying.add_metric([kind], stats.retrying.get(kind, 0))
        yield length
        yield age
        yield dead
        yield retrying
        opened = open_transaction_age(self.metrics)
        if opened is not None:
            yield GaugeMetricFamily(f"{self.prefix}oldest_transaction_seconds",
                                    "Seconds the oldest transaction open in the database has been open; 0: none.",
                                    value=opened)
