"""OpenTelemetry: a trace from the request that enqueued a job to the run that handled it, and the queue's
metrics through the OpenTelemetry meter (``pip install "sqla-jobs[otel]"``; see docs/howto/tracing.md).

Configure the OpenTelemetry SDK as usual (a ``TracerProvider`` with your exporter), then instrument the
app, in the web app that enqueues and in the worker that runs the jobs (``--app`` imports the module)::

    from sqla_jobs.otel import instrument

    instrument(queue)                    # retries="link" (default) or "parent"

**Enqueue.** Each job added afterwards (``session.add(Job(...))`` at flush, ``queue.enqueue``,
``enqueue_unique``, ``enqueue_many``, on a ``Session`` or an ``AsyncSession``) stores the W3C trace
context of the span current at that moment (``traceparent``, and ``tracestate`` when there is one) in
its ``trace_context`` column; no current span, nothing stored. Baggage is not stored.

**Run.** The worker runs each attempt in a span of kind ``CONSUMER``, named ``process <queue>``, with the
messaging conventions' attributes (``messaging.system`` ``sqla_jobs``, ``messaging.operation.name`` and
``messaging.operation.type`` ``process``, ``messaging.destination.name`` the queue,
``messaging.message.id`` the job id) and sqla-jobs' own (``sqla_jobs.job.kind``, ``sqla_jobs.job.attempt``,
``sqla_jobs.job.max_attempts``, ``sqla_jobs.job.outcome``). The first attempt's span is a child of the
enqueuing span; a later attempt's starts a trace of its own with a link to it (``retries="parent"``:
every attempt is a child). A failure sets the status to ERROR and records the exception (an event with
its type, message and stack trace); a finish, a snooze or a cancel leaves it unset, as the conventions
ask of a library. The span is current while the handler runs, so the handler's own spans are its
children. With tracing on, the threaded worker reads the stored contexts of each claim's jobs in one
statement (``sqla_jobs.worker.run_reads``); the async worker's runs read their own, one primary-key read each.

**Durable jobs.** Each ``step`` is a child span of the run's, named ``step <name>``, with
``sqla_jobs.step.outcome`` ``ran`` or ``replayed`` (its stored value returned), and its function's error
recorded; each sleep or wait is one too (``sleep <name>``, ``wait <key>``: ``parked``, ``passed``, ``event``,
``timed out`` or ``woke``). ``queue.emit_event`` is a ``PRODUCER`` span ``emit <key>`` in the caller's trace,
with ``sqla_jobs.event.woken``: how many parked jobs it made due; ``queue.emit_events`` is one span
``emit <n> events`` (``messaging.batch.message_count``: n) with the same count.

**Relay.** ``sqla-jobs relay`` sends each message of a job with a stored context in a ``PRODUCER`` span
``send <destination>``, child of the enqueuing span (status ERROR if the broker refused it or was lost), and
puts that span's ``traceparent`` / ``tracestate`` in the message's headers: the consumer's span is its child.

**Metrics.** ``QueueMeter(queue, engine)`` reports the figures of ``sqla_jobs.metrics`` (Prometheus)
through the OpenTelemetry meter: counters and a run-time histogram fed by the app's hooks, gauges read
from ``stats`` when the meter's reader collects (at most every ``stats_max_age`` seconds).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.orm.attributes import instance_dict

from ._app import JobEvent, JobQueue
from ._stats import COUNTED, COUNTERS, QueueLength, QueueStats, cached_stats, open_transaction_age
from .errors import ConfigError

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Link, Span, SpanKind, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised in a subprocess by the tests
    raise ConfigError("tracing needs the OpenTelemetry packages: pip install \"sqla-jobs[otel]\"") from None

__all__ = ["RETRIES", "SYSTEM", "QueueMeter", "instrument", "uninstrument"]

log = logging.getLogger("sqla_jobs.otel")

#: ``messaging.system`` of every span.
SYSTEM = "sqla_jobs"
#: How a retry's span relates to the enqueuing span: a link (a trace of its own), or a child like the first.
RETRIES = ("link", "parent")
#: Outcomes (``sqla_jobs.worker.outcomes``) that are failures: the span's status is ERROR.
_FAILED = frozenset({"error", "outage", "lost", "nack", "unroutable", "broker_lost"})
_PROPAGATOR = TraceContextTextMapPropagator()


def instrument(queue: JobQueue[Any, Any], *, retries: str = "link", tracer_provider: Any = None) -> None:
    """Store the caller's trace context with each job ``queue`` enqueues, and run each job in a span.

    ``tracer_provider``: the SDK's provider to make spans with (default: the global one). Call it once per
    process, before enqueuing or starting a worker; ``uninstrument`` undoes it.
    """
    if retries not in RETRIES:
        raise ConfigError(f"retries must be one of {', '.join(map(repr, RETRIES))}, got {retries!r}")
    uninstrument(queue)
    tracer = trace.get_tracer("sqla_jobs", tracer_provider=tracer_provider)
    tracing = _Tracing(tracer, retries)
    event.listen(queue.job_model, "before_insert", tracing.stamp, propagate=True)
    queue.tracing = tracing


def uninstrument(queue: JobQueue[Any, Any]) -> None:
    """Stop storing trace contexts and making spans for ``queue`` (no-op when it is not instrumented)."""
    tracing = queue.tracing
    if isinstance(tracing, _Tracing):
        event.remove(queue.job_model, "before_insert", tracing.stamp)
    queue.tracing = None


def current_context() -> dict[str, str] | None:
    """The W3C trace context of the current span (``traceparent``, ``tracestate``), or None if there is none."""
    return _encoded(trace.get_current_span().get_span_context())[0]


#: The last span context seen and its two forms: ``enqueue_many`` and a flush of many jobs ask once per row,
#: almost always inside one span. One tuple, replaced whole, so threads never see half of an update.
_last: tuple[Any, dict[str, str] | None, str | None] = (None, None, None)


def _encoded(span_context: Any) -> tuple[dict[str, str] | None, str | None]:
    """``span_context`` as the stored dict and its JSON text; (None, None) when it is not valid (no span)."""
    global _last
    last = _last
    if last[0] is span_context:
        return last[1], last[2]
    carrier: dict[str, str] = {}
    if span_context.is_valid:
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(trace.NonRecordingSpan(span_context)))
    found = (carrier, json.dumps(carrier, separators=(",", ":"))) if carrier else (None, None)
    _last = (span_context, *found)
    return found


class _Tracing:
    """What ``instrument`` puts on the app (``queue.tracing``): the enqueue side's stamp, the worker's span."""

    def __init__(self, tracer: Any, retries: str) -> None:
        self.tracer = tracer
        self.retries = retries

    # -- enqueue ---------------------------------------------------------------------------------

    def stamp(self, mapper: Any, connection: Any, target: Any) -> None:
        """``before_insert`` of the job model: a new ``Job`` stores the current span's context."""
        if instance_dict(target).get("trace_context") is None:
            found = current_context()
            if found is not None:
                target.trace_context = dict(found)  # its own copy: the cached one is shared

    def carrier(self) -> str | None:
        """The current span's context as JSON text, for a row of ``enqueue_unique`` / ``enqueue_many``."""
        return _encoded(trace.get_current_span().get_span_context())[1]

    # -- run ---------------------------------------------------------------------------------------

    def run(self, run: Any, read: Callable[[], dict[int, dict[str, str]]], execute: Callable[[], Any]) -> Any:
        """``execute()`` (the executor's run of ``run``) inside the run's span; its ``Outcome``."""
        with self._span(run, _read(read, run.job.id)) as span:
            outcome = execute()
            _end(span, run, outcome)
        return outcome

    async def run_async(self, run: Any, read: Callable[[], Awaitable[dict[int, dict[str, str]]]],
                        execute: Callable[[], Awaitable[Any]]) -> Any:
        """The same for the async executor: ``await execute()`` inside the span, in the run's task."""
        try:
            stored = (await read()).get(run.job.id)
        except Exception as exc:
            stored = _unread(exc)
        with self._span(run, stored) as span:
            outcome = await execute()
            _end(span, run, outcome)
        return outcome

    @contextmanager
    def _span(self, run: Any, stored: dict[str, str] | None) -> Iterator[Span]:
        job = run.job
        parent = otel_context.Context()  # a root unless the job says otherwise: never the worker's own
        links = []
        if stored:
            enqueued = _PROPAGATOR.extract(stored)
            if job.attempt <= 1 or self.retries == "parent":
                parent = enqueued
            else:
                span_context = trace.get_current_span(enqueued).get_span_context()
                if span_context.is_valid:
                    links.append(Link(span_context, {"sqla_jobs.link": "enqueued"}))
        attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.destination.name": job.queue,
            "messaging.message.id": str(job.id),
            "sqla_jobs.job.kind": job.kind,
            "sqla_jobs.job.attempt": job.attempt,
            "sqla_jobs.job.max_attempts": job.max_attempts,
        }
        with self.tracer.start_as_current_span(f"process {job.queue}", context=parent, kind=SpanKind.CONSUMER,
                                               links=links, attributes=attributes, record_exception=False,
                                               set_status_on_exception=False) as span:
            yield span

    # -- durable jobs (sqla_jobs._durable) ---------------------------------------------------------------

    @contextmanager
    def step(self, what: str, name: str, attributes: dict[str, Any]) -> Iterator[Span]:
        """A durable job's step, sleep or wait: a child of the run's span (current in the handler). An error of the
        step's function is recorded; a park (``JobParked``, not an ``Exception``) is an outcome, not an error."""
        with self.tracer.start_as_current_span(f"{what} {name}", attributes={"sqla_jobs.step.name": name, **attributes},
                                               record_exception=False, set_status_on_exception=False) as span:
            try:
                yield span
            except Exception as exc:
                span.record_exception(exc)
                span.set_status(StatusCode.ERROR, f"{type(exc).__qualname__}: {exc}")
                raise

    @contextmanager
    def emit(self, key: str | None, count: int = 1) -> Iterator[Span]:
        """``queue.emit_event`` (``key``) or ``emit_events`` (``count`` events, no key): a span in the caller's trace,
        with the key or the batch's size, and how many parked jobs it woke."""
        attributes: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.operation.name": "emit",
                                      "messaging.operation.type": "send"}
        if key is not None:
            attributes["sqla_jobs.event.key"] = key
        else:
            attributes["messaging.batch.message_count"] = count
        name = f"emit {key}" if key is not None else f"emit {count} events"
        with self.tracer.start_as_current_span(name, kind=SpanKind.PRODUCER, attributes=attributes) as span:
            yield span

    # -- the relay -------------------------------------------------------------------------------------

    def publish(self, system: str, messages: list[Any], contexts: dict[int, dict[str, str]],
                route: Callable[[str], str | None]) -> dict[int, Span]:
        """The relay's send of each message whose job has a stored context: a ``PRODUCER`` span, child of the
        enqueuing span, whose own context goes in the message's headers (the consumer's span is its child)."""
        spans = {}
        for message in messages:
            stored = contexts.get(message.job.id)
            if not stored:
                continue
            destination = route(message.job.kind) or ""
            span = self.tracer.start_span(f"send {destination}", context=_PROPAGATOR.extract(stored),
                                          kind=SpanKind.PRODUCER, attributes={
                                              "messaging.system": system, "messaging.operation.name": "send",
                                              "messaging.operation.type": "send",
                                              "messaging.destination.name": destination,
                                              "messaging.message.id": str(message.job.id),
                                              "sqla_jobs.job.kind": message.job.kind})
            _PROPAGATOR.inject(message.headers, context=trace.set_span_in_context(span))
            spans[message.job.id] = span
        return spans

    @staticmethod
    def published(spans: dict[int, Span], answers: dict[int, str | None], lost: str | None) -> None:
        """End the relay's send spans with the broker's answer: a refusal, or the broker lost, is an ERROR."""
        for job_id, span in spans.items():
            refused = lost if lost is not None else answers.get(job_id)
            if refused is not None:
                span.set_status(StatusCode.ERROR, refused)
            span.end()


def _read(read: Callable[[], dict[int, dict[str, str]]], job_id: int) -> dict[str, str] | None:
    try:
        return read().get(job_id)
    except Exception as exc:
        return _unread(exc)


def _unread(exc: Exception) -> None:
    # The run goes on without a parent: a trace is not worth a job (the database may be away; the run sees).
    log.warning("tracing: could not read the job's trace context: %s", str(exc).splitlines()[0])
    return None


def _end(span: Span, run: Any, outcome: Any) -> None:
    """The outcome as the span's status and attributes, the exception recorded."""
    result = "abandoned" if run.abandoned else outcome.result
    span.set_attribute("sqla_jobs.job.outcome", result)
    if outcome.exception is not None:
        span.record_exception(outcome.exception)
    if result == "abandoned":
        span.set_status(StatusCode.ERROR, "the run was abandoned (timed out, lease lost or given back): "
                                          "its result was discarded")
    elif result in _FAILED:
        span.set_attribute("error.type", type(outcome.exception).__qualname__ if outcome.exception is not None
                           else outcome.error.split(":", 1)[0] or result)
        span.set_status(StatusCode.ERROR, outcome.error or result)


# -- metrics -----------------------------------------------------------------------------------------


class QueueMeter:
    """The figures of ``sqla_jobs.metrics.QueueMetrics`` through the OpenTelemetry meter.

    Counters ``sqla_jobs.jobs.<finished|failed|retried|dead_lettered|cancelled|lost>`` and the histogram
    ``sqla_jobs.job.run.duration`` (seconds) with the attribute ``sqla_jobs.job.kind``, fed by ``queue``'s
    hooks (what this process did); with an ``engine``, the gauges ``sqla_jobs.queue.length`` (``queue``,
    ``state``: ready, scheduled, running, blocked), ``sqla_jobs.queue.oldest_pending_age`` (seconds, by
    queue), ``sqla_jobs.dead_jobs`` and ``sqla_jobs.retrying_jobs`` (by kind), read from ``queue.stats``
    when the reader collects, at most once per ``stats_max_age`` seconds; and on PostgreSQL and MariaDB
    ``sqla_jobs.db.oldest_transaction`` (seconds; 0: none), which SQLite does not report.
    """

    def __init__(self, queue: JobQueue[Any, Any], engine: Engine | None = None, *, meter_provider: Any = None,
                 stats_max_age: float = 5.0) -> None:
        self.queue = queue
        self.engine = engine
        self.stats_max_age = stats_max_age
        meter = metrics.get_meter("sqla_jobs", meter_provider=meter_provider)
        self._counters = {name: meter.create_counter(f"sqla_jobs.jobs.{name}", unit="{job}", description=text)
                          for name, text in COUNTERS.items()}
        self.run_duration = meter.create_histogram(
            "sqla_jobs.job.run.duration", unit="s", description="Run time of job runs (finished and failed runs).")
        for name in COUNTED:
            queue.on(name)(self._on_event)
        self._lock = threading.Lock()
        self._cached: tuple[float, QueueStats | None] = (-1e9, None)
        self._open_cached: tuple[float, float | None] = (-1e9, None)
        self._seen_queues: set[str] = {"default"}
        self._seen_dead: set[str] = set()
        self._seen_retrying: set[str] = set()
        if engine is not None:
            meter.create_observable_gauge("sqla_jobs.queue.length", [self._lengths], unit="{job}",
                                          description="Jobs in the table by queue and state.")
            meter.create_observable_gauge("sqla_jobs.queue.oldest_pending_age", [self._ages], unit="s",
                                          description="Seconds the oldest due job has waited, by queue; 0: none.")
            meter.create_observable_gauge("sqla_jobs.dead_jobs", [self._dead], unit="{job}",
                                          description="Jobs in the dead-letter table, by kind.")
            meter.create_observable_gauge("sqla_jobs.retrying_jobs", [self._retrying], unit="{job}",
                                          description="Pending jobs that failed at least once, by kind.")
            meter.create_observable_gauge("sqla_jobs.db.oldest_transaction", [self._open], unit="s",
                                          description="Seconds the oldest transaction open in the database has "
                                                      "been open; 0: none (PostgreSQL, MariaDB).")

    def detach(self) -> None:
        """Stop counting this app's events (the instruments stay with the meter, reporting what they have)."""
        for name in COUNTED:
            self.queue.off(name, self._on_event)

    def _on_event(self, job_event: JobEvent) -> None:
        attributes = {"sqla_jobs.job.kind": job_event.kind}
        for name in COUNTED[job_event.name]:
            self._counters[name].add(1, attributes)
        if job_event.duration is not None and job_event.name in ("finished", "failed", "dead_letter"):
            self.run_duration.record(job_event.duration, attributes)

    def table_stats(self) -> QueueStats | None:
        """The cheap figures, at most ``stats_max_age`` seconds old; None if the database did not answer."""
        return cached_stats(self)

    def _queues(self) -> Iterable[QueueLength]:
        stats = self.table_stats()
        if stats is None:
            return []
        found = {q.queue: q for q in stats.queues}
        self._seen_queues.update(found)  # a queue that empties reports 0 rather than vanishing
        return [found.get(name, QueueLength(name)) for name in sorted(self._seen_queues)]

    def _lengths(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(getattr(q, state), {"queue": q.queue, "state": state})
                for q in self._queues() for state in ("ready", "scheduled", "running", "blocked")]

    def _ages(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(q.oldest_pending_age or 0.0, {"queue": q.queue}) for q in self._queues()]

    def _dead(self, options: CallbackOptions) -> Iterable[Observation]:
        stats = self.table_stats()
        totals = {} if stats is None else {d.kind: d.total for d in stats.dead}
        self._seen_dead.update(totals)
        return [Observation(totals.get(kind, 0), {"sqla_jobs.job.kind": kind}) for kind in sorted(self._seen_dead)]

    def _retrying(self, options: CallbackOptions) -> Iterable[Observation]:
        stats = self.table_stats()
        counts = {} if stats is None else dict(stats.retrying)
        self._seen_retrying.update(counts)
        return [Observation(counts.get(kind, 0), {"sqla_jobs.job.kind": kind})
                for kind in sorted(self._seen_retrying)]

    def _open(self, options: CallbackOptions) -> Iterable[Observation]:
        seconds = open_transaction_age(self)
        return [] if seconds is None else [Observation(seconds)]
