"""tests.app's queue under OpenTelemetry, for worker processes (``--app tests.otel_app:queue``).

The SDK's own ``ConsoleSpanExporter`` writes each span as it ends, one line of JSON, to the file named by
``SQLA_JOBS_TEST_SPANS``: what the test reads back. ``SQLA_JOBS_TEST_RETRIES`` is ``instrument``'s
``retries`` (default ``link``).
"""

from __future__ import annotations

import os

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from sqla_jobs.otel import instrument
from tests import app


def _line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


provider = TracerProvider()
_spans = open(os.environ["SQLA_JOBS_TEST_SPANS"], "a")  # noqa: SIM115 - open for the process's life
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=_spans, formatter=_line)))
queue = app.queue
instrument(queue, retries=os.environ.get("SQLA_JOBS_TEST_RETRIES", "link"), tracer_provider=provider)
