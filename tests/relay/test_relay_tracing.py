"""The relay with tracing on (``sqla_jobs.otel``): each message of a traced job is sent in a ``PRODUCER`` span, child of
the span that enqueued the job, and carries that span's context in its ``traceparent`` header, so the consumer continues
the trace of the request that enqueued the job."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session

from sqla_jobs.otel import instrument, uninstrument
from sqla_jobs.relay import HEADER_ID, Relay
from tests.conftest import Database
from tests.relay_app import RelayJob, queue

from .brokers import BrokerSpace


def test_each_message_is_sent_in_a_span_of_the_enqueuing_trace_and_carries_it(relay_db: Database,
                                                                                space: BrokerSpace) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(queue, tracer_provider=provider)
    try:
        with provider.get_tracer("tests").start_as_current_span("POST /orders") as request, \
                Session(relay_db.engine) as session, session.begin():
            session.add(RelayJob(kind="order.created", queue="relay", payload={"order": 1}))
            queue.enqueue_many(session, [{"kind": "order.paid", "queue": "relay", "payload": {"order": 1}}])
        with Session(relay_db.engine, expire_on_commit=False) as session, session.begin():  # outside any span
            untraced = queue.enqueue(session, "order.created", {"order": 2}, queue="relay")
        routes = {"order.created": "stored.orders.created", "order.paid": "stored.orders.paid"}
        counts = Relay(relay_db.engine, queue, space.target(routes)).run(until_idle=True)
    finally:
        uninstrument(queue)
    assert counts.published == 3
    context = request.get_span_context()
    sends = {span.attributes["messaging.message.id"]: span for span in exporter.get_finished_spans()
             if span.name.startswith("send ")}
    received = {message.headers[HEADER_ID]: message.headers for message in space.read_all(expect=3)}
    assert sorted(sends) == sorted(job_id for job_id in received if job_id != str(untraced.id))  # no span untraced
    for job_id, span in sends.items():
        assert span.kind.name == "PRODUCER" and span.attributes["messaging.system"] == space.broker
        assert span.parent is not None and span.parent.span_id == context.span_id  # the enqueuing span's child
        assert span.context.trace_id == context.trace_id and span.status.status_code.name == "UNSET"
        assert span.attributes["messaging.destination.name"].endswith(routes[span.attributes["sqla_jobs.job.kind"]])
        # the message carries the send span: the consumer's span will be its child, in the request's trace
        assert received[job_id]["traceparent"] == (f"00-{context.trace_id:032x}-{span.context.span_id:016x}-"
                                                   f"{context.trace_flags:02x}")
    assert "traceparent" not in received[str(untraced.id)]
