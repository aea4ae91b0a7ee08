"""OpenTelemetry (``sqla_jobs.otel``): the enqueuing span's context is stored with the job on every enqueue
path and backend, a worker process runs each attempt in a consumer span parented on (first attempt) or
linked to (retries) that span, and ``QueueMeter`` reports the queue's figures through the meter.

The relay's headers are tested in tests/relay/test_relay_tracing.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from sqla_jobs import AsyncWorker, JobQueue, Worker
from sqla_jobs.errors import ConfigError
from sqla_jobs.otel import QueueMeter, instrument, uninstrument
from tests import app
from tests.conftest import ROOT, Database, run_cli
from tests.test_asyncio import run


@pytest.fixture
def tracer() -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    """tests.app's queue instrumented with an in-memory exporter; a tracer for the test's own "request" span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(app.queue, tracer_provider=provider)
    try:
        yield provider.get_tracer("tests"), exporter
    finally:
        uninstrument(app.queue)


def traceparent(span: Any) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


def stored(db: Database) -> dict[str, Any]:
    """Each job's ``trace_context``, by its payload's ``path`` (the enqueue path that wrote it)."""
    with Session(db.engine) as session:
        return {job.payload["path"]: job.trace_context for job in session.scalars(select(app.Job))}


def test_every_enqueue_path_stores_the_current_span_and_none_without_one(
        db: Database, tracer: tuple[Tracer, InMemorySpanExporter]) -> None:
    tracer_, _ = tracer
    with tracer_.start_as_current_span("request") as request, Session(db.engine) as session, session.begin():
        session.add(app.Job(kind="noop", payload={"path": "orm"}))
        app.queue.enqueue(session, "noop", {"path": "enqueue"})
        app.queue.enqueue(session, "noop", {"path": "unique"}, unique_key="u")
        app.queue.enqueue_many(session, [{"kind": "noop", "payload": {"path": "many"}},  # COPY on PostgreSQL
                                         {"kind": "noop", "payload": {"path": "many-keyed"}, "unique_key": "k"}])
    with Session(db.engine) as session, session.begin():  # no current span: nothing stored
        session.add(app.Job(kind="noop", payload={"path": "orm-outside"}))
        app.queue.enqueue_many(session, [{"kind": "noop", "payload": {"path": "many-outside"}}])

    async def scenario(engine: Any) -> None:
        with tracer_.start_as_current_span("async request") as span:
            async with AsyncSession(engine) as session, session.begin():
                session.add(app.Job(kind="noop", payload={"path": "async-orm"}))
                await app.queue.aio.enqueue_many(session, [{"kind": "noop", "payload": {"path": "async-many"}}])
                await app.queue.aio.enqueue(session, "noop", {"path": "async-unique"}, unique_key="a")
        scenario.parent = traceparent(span)  # type: ignore[attr-defined]

    run(db, scenario)
    found = stored(db)
    expected = {"traceparent": traceparent(request)}
    for path in ("orm", "enqueue", "unique", "many", "many-keyed"):
        assert found[path] == expected, path
    assert found["orm-outside"] is None and found["many-outside"] is None
    for path in ("async-orm", "async-many", "async-unique"):
        assert found[path] == {"traceparent": scenario.parent}, path  # type: ignore[attr-defined]


def test_a_replacing_duplicate_gives_the_holder_its_trace_and_a_kept_one_does_not(
        db: Database, tracer: tuple[Tracer, InMemorySpanExporter]) -> None:
    tracer_, _ = tracer
    for name, on_duplicate in (("first", "keep"), ("kept", "keep"), ("replaced", "replace")):
        with tracer_.start_as_current_span(name) as span, Session(db.engine) as session, session.begin():
            app.queue.enqueue(session, "noop", {"path": "k"}, unique_key="k", on_duplicate=on_duplicate)
        if name != "kept":
            expected = {"traceparent": traceparent(span)}
        assert stored(db) == {"k": expected}, name


def test_without_instrument_nothing_is_stored(db: Database) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    with TracerProvider().get_tracer("t").start_as_current_span("request"), Session(db.engine) as session, \
            session.begin():
        session.add(app.Job(kind="noop", payload={"path": "orm"}))
        app.queue.enqueue_many(session, [{"kind": "noop", "payload": {"path": "many"}}])
    assert stored(db) == {"orm": None, "many": None}


def spans_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("retries", ["link", "parent"])
def test_a_worker_process_runs_each_attempt_in_a_span_of_the_enqueuing_trace(
        db: Database, tracer: tuple[Tracer, InMemorySpanExporter], tmp_path: Path, retries: str) -> None:
    tracer_, _ = tracer
    with tracer_.start_as_current_span("POST /orders") as request, \
            Session(db.engine, expire_on_commit=False) as session, session.begin():
        ok = app.Job(kind="noop", payload={}, queue="emails")
        session.add(ok)
        failing = app.queue.enqueue(session, "fail", {"message": "card declined"}, max_attempts=2)
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        untraced = app.queue.enqueue(session, "noop", {})
    spans = tmp_path / "spans.jsonl"
    result = run_cli("worker", "--burst", "--app", "tests.otel_app:queue", "--queue", "default",
                     "--queue", "emails", env=db.env(SQLA_JOBS_TEST_SPANS=str(spans), SQLA_JOBS_TEST_RETRIES=retries))
    assert result.returncode == 0, result.stderr
    found = {(s["attributes"]["messaging.message.id"], s["attributes"]["sqla_jobs.job.attempt"]): s
             for s in spans_of(spans)}
    assert sorted(found) == sorted([(str(ok.id), 1), (str(failing.id), 1), (str(failing.id), 2),
                                    (str(untraced.id), 1)])
    trace_id = f"0x{request.get_span_context().trace_id:032x}"
    span_id = f"0x{request.get_span_context().span_id:016x}"

    first = found[(str(ok.id), 1)]
    assert (first["name"], first["kind"]) == ("process emails", "SpanKind.CONSUMER")
    assert (first["context"]["trace_id"], first["parent_id"]) == (trace_id, span_id)
    assert first["attributes"] == {
        "messaging.system": "sqla_jobs", "messaging.operation.name": "process", "messaging.operation.type": "process",
        "messaging.destination.name": "emails", "messaging.message.id": str(ok.id), "sqla_jobs.job.kind": "noop",
        "sqla_jobs.job.attempt": 1, "sqla_jobs.job.max_attempts": 5, "sqla_jobs.job.outcome": "ok"}
    assert first["status"]["status_code"] == "UNSET" and first["links"] == []

    for attempt in (1, 2):
        span = found[(str(failing.id), attempt)]
        assert span["status"] == {"status_code": "ERROR", "description": "ValueError: card declined"}
        assert span["attributes"]["error.type"] == "ValueError"
        [exception] = [e for e in span["events"] if e["name"] == "exception"]
        assert exception["attributes"]["exception.type"] == "ValueError"
        assert "card declined" in exception["attributes"]["exception.message"]
        assert "raise ValueError" in exception["attributes"]["exception.stacktrace"]
    assert found[(str(failing.id), 1)]["parent_id"] == span_id
    retry = found[(str(failing.id), 2)]
    if retries == "link":  # a trace of its own, linked to the request
        assert retry["parent_id"] is None and retry["context"]["trace_id"] != trace_id
        assert [(link["context"]["trace_id"], link["context"]["span_id"]) for link in retry["links"]] == [
            (trace_id, span_id)]
    else:
        assert (retry["context"]["trace_id"], retry["parent_id"], retry["links"]) == (trace_id, span_id, [])

    alone = found[(str(untraced.id), 1)]  # enqueued outside any span: a root, no link
    assert alone["parent_id"] is None and alone["links"] == [] and alone["context"]["trace_id"] != trace_id


@pytest.mark.parametrize("worker", ["thread", "async"])
def test_the_handler_runs_inside_its_span_in_both_executors(db: Database, worker: str) -> None:
    """The job's span is current in the handler, sync or async, under Worker and AsyncWorker: its spans are
    children; and the first attempt's span is the enqueuing span's child there too."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer_ = provider.get_tracer("tests")
    queue = JobQueue(app.Job, app.DeadJob, check_kinds=False)  # its check stays on the model: it must pass all

    @queue.handler("plain")
    def plain(payload: dict[str, Any]) -> None:
        with tracer_.start_as_current_span("inside plain"):
            pass

    @queue.handler("coroutine")
    async def coroutine(payload: dict[str, Any]) -> None:
        with tracer_.start_as_current_span("inside coroutine"):
            await asyncio.sleep(0)

    instrument(queue, tracer_provider=provider)
    try:
        with tracer_.start_as_current_span("request") as request, Session(db.engine) as session, session.begin():
            queue.enqueue_many(session, [{"kind": "plain"}, {"kind": "coroutine"}])
        if worker == "thread":
            Worker(db.engine, queue).run(burst=True)
        else:
            run(db, lambda engine: AsyncWorker(engine, queue, poll_interval=0.05).run(burst=True))
    finally:
        uninstrument(queue)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    jobs = [span for span in exporter.get_finished_spans() if span.name == "process default"]
    assert len(jobs) == 2
    for job_span in jobs:
        assert job_span.parent is not None and job_span.parent.span_id == request.get_span_context().span_id
        inside = spans[f"inside {job_span.attributes['sqla_jobs.job.kind']}"]
        assert inside.parent is not None and inside.parent.span_id == job_span.context.span_id


def test_retries_must_be_link_or_parent() -> None:
    with pytest.raises(ConfigError, match="retries must be one of 'link', 'parent'"):
        instrument(app.queue, retries="child")
    assert app.queue.tracing is None


def test_queue_meter_reports_the_prometheus_figures(db: Database) -> None:
    reader = InMemoryMetricReader()
    meter = QueueMeter(app.queue, db.engine, meter_provider=MeterProvider(metric_readers=[reader]), stats_max_age=0)
    try:
        with Session(db.engine) as session, session.begin():
            for _ in range(3):
                session.add(app.Job(kind="noop", payload={}))
            session.add(app.Job(kind="fail", payload={}, max_attempts=2))
        Worker(db.engine, app.queue).run(burst=True)
        with Session(db.engine) as session, session.begin():
            session.add(app.Job(kind="noop", payload={}, queue="later"))
        points = {}
        for resource in reader.get_metrics_data().resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        key = (metric.name, tuple(sorted(point.attributes.items())))
                        points[key] = point.count if hasattr(point, "bucket_counts") else point.value
    finally:
        meter.detach()
    kind = (("sqla_jobs.job.kind", "noop"),)
    failing = (("sqla_jobs.job.kind", "fail"),)
    assert points[("sqla_jobs.jobs.finished", kind)] == 3
    assert points[("sqla_jobs.jobs.failed", failing)] == 2
    assert points[("sqla_jobs.jobs.retried", failing)] == 1
    assert points[("sqla_jobs.jobs.dead_lettered", failing)] == 1
    assert points[("sqla_jobs.job.run.duration", kind)] == 3
    assert points[("sqla_jobs.job.run.duration", failing)] == 2
    assert points[("sqla_jobs.queue.length", (("queue", "later"), ("state", "ready")))] == 1
    assert points[("sqla_jobs.queue.length", (("queue", "default"), ("state", "ready")))] == 0
    assert points[("sqla_jobs.dead_jobs", failing)] == 1


def test_core_never_imports_opentelemetry_and_the_module_says_what_to_install(db: Database) -> None:
    enqueue_and_run = ("import sys; from sqlalchemy import create_engine; from sqlalchemy.orm import Session; "
                       "from sqla_jobs import Worker; from tests import app; import os; "
                       "e = create_engine(os.environ['SQLA_JOBS_URL']); "
                       "s = Session(e); s.add(app.Job(kind='noop', payload={})); "
                       "app.queue.enqueue_many(s, [{'kind': 'noop'}]); s.commit(); "
                       "Worker(e, app.queue).run(burst=True); "
                       "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    result = subprocess.run([sys.executable, "-c", enqueue_and_run], env=db.env(), cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    missing = "import sys; sys.modules['opentelemetry'] = None; import sqla_jobs.otel"
    result = subprocess.run([sys.executable, "-c", missing], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert 'pip install "sqla-jobs[otel]"' in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["d_wait", "d_async_wait"])
def test_a_durable_jobs_steps_and_waits_are_child_spans_and_an_emit_is_a_span_of_its_caller(
        db: Database, tracer: tuple[Tracer, InMemorySpanExporter], kind: str) -> None:
    """Under ``instrument``, each step, sleep and wait of a run is a child of the run's span with its outcome, and
    ``emit_event`` is a span in the emitting request's trace; the threaded worker runs the plain handler, the async
    worker the ``async def`` one."""
    from tests import durable_app  # noqa: F401 - registers the durable handlers on tests.app's queue

    tracer_, exporter = tracer
    with Session(db.engine, expire_on_commit=False) as session, session.begin():
        job = app.queue.enqueue(session, kind, {"key": "paid:span"})

    def work() -> None:
        if kind == "d_wait":
            Worker(db.engine, app.queue, poll_interval=0.05).run(burst=True)
        else:
            run(db, lambda engine: AsyncWorker(engine, app.queue, poll_interval=0.05).run(burst=True))

    def runs() -> list[list[tuple[str, Any]]]:
        """Each run's child spans (name, outcome), in the order they ended; the exporter emptied."""
        spans = exporter.get_finished_spans()
        exporter.clear()
        found = []
        for process in [s for s in spans if s.name == "process default"]:
            assert process.attributes["messaging.message.id"] == str(job.id)
            assert process.attributes["sqla_jobs.job.attempt"] == 1  # a park uses no attempt
            found.append([(s.name, s.attributes.get("sqla_jobs.step.outcome")) for s in spans
                          if s.parent is not None and s.parent.span_id == process.context.span_id])
        return found

    work()  # parks at the wait
    assert runs() == [[("step before", "ran"), ("wait paid:span", "parked")]]
    with tracer_.start_as_current_span("POST /webhook") as hook, Session(db.engine) as session, session.begin():
        assert app.queue.emit_event(session, "paid:span", {"amount": 1}) == 1
    [emit] = [s for s in exporter.get_finished_spans() if s.name == "emit paid:span"]
    assert emit.parent is not None and emit.parent.span_id == hook.get_span_context().span_id
    assert emit.attributes["sqla_jobs.event.key"] == "paid:span" and emit.attributes["sqla_jobs.event.woken"] == 1
    exporter.clear()
    work()  # resumes: the first step replayed, the wait passed (the emit ended it), the rest ran
    expected = [("step before", "replayed"), ("wait paid:span", "passed"), ("step after", "ran")]
    if kind == "d_async_wait":  # its handler also sleeps 0 s: passed at once
        expected.insert(2, ("sleep sleep:1", "woke"))
    assert runs() == [expected]



def test_emit_events_is_one_producer_span_of_its_caller_with_the_batch_size_and_the_jobs_it_woke(
        db: Database, tracer: tuple[Tracer, InMemorySpanExporter]) -> None:
    from tests import durable_app  # noqa: F401 - registers the durable handlers on tests.app's queue

    tracer_, exporter = tracer
    with Session(db.engine) as session, session.begin():
        app.queue.enqueue(session, "d_wait", {"key": "paid:batch"})
    Worker(db.engine, app.queue, poll_interval=0.05).run(burst=True)  # parks at the wait
    exporter.clear()
    with tracer_.start_as_current_span("POST /webhook") as hook, Session(db.engine) as session, session.begin():
        assert app.queue.emit_events(session, {"paid:batch": 1, "paid:other": 2}) == 1
    [emit] = [s for s in exporter.get_finished_spans() if s.name.startswith("emit")]
    assert (emit.name, str(emit.kind)) == ("emit 2 events", "SpanKind.PRODUCER")
    assert emit.parent is not None and emit.parent.span_id == hook.get_span_context().span_id
    assert emit.attributes["messaging.batch.message_count"] == 2 and emit.attributes["sqla_jobs.event.woken"] == 1

def test_the_threaded_worker_reads_a_claims_trace_contexts_in_one_statement(
        db: Database, tracer: tuple[Tracer, InMemorySpanExporter]) -> None:
    """Not one read per run on its handler thread (where, among many threads, each waited for the GIL): the worker
    reads the stored contexts of each claim's jobs together, and every run still gets its own as its parent."""
    from sqlalchemy import event

    tracer_, exporter = tracer
    with tracer_.start_as_current_span("request") as request, Session(db.engine) as session, session.begin():
        app.queue.enqueue_many(session, [{"kind": "noop", "payload": {"n": n}} for n in range(12)])
    reads: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "trace_context" in statement:
            reads.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        Worker(db.engine, app.queue, concurrency=4, poll_interval=0.05).run(burst=True, install_signals=False)
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    runs = [span for span in exporter.get_finished_spans() if span.name == "process default"]
    assert len(runs) == 12
    assert all(span.parent is not None and span.parent.span_id == request.get_span_context().span_id for span in runs)
    assert 1 <= len(reads) <= 12 // 2, reads  # claims of up to 4 jobs: at most one read each, never one per run
