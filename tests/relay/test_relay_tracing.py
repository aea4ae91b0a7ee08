"""The relay with tracing on (``sqla_jobs.otel``): each message carries its job's stored trace context in
the ``traceparent`` header, so the consumer continues the trace of the request that enqueued the job."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy.orm import Session

from sqla_jobs.otel import instrument, uninstrument
from sqla_jobs.relay import HEADER_ID, Relay
from tests.conftest import Database
from tests.relay_app import RelayJob, queue

from .brokers import BrokerSpace


def test_each_message_carries_the_enqueuing_spans_traceparent(relay_db: Database, space: BrokerSpace) -> None:
    provider = TracerProvider()
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
    expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    received = {message.headers[HEADER_ID]: message.headers for message in space.read_all(expect=3)}
    assert sorted(headers.get("traceparent") for job_id, headers in received.items()
                  if job_id != str(untraced.id)) == [expected, expected]
    assert "traceparent" not in received[str(untraced.id)]
