"""What the relay hands a broker: one ``Outgoing`` message per claimed job, and the ``Target`` seam.

The body is the job's payload as compact JSON (UTF-8), exactly the object the
enqueuing code stored. Everything else travels in headers, so a consumer can
route and deduplicate without parsing the body:

* the job id is the broker's deduplication key: RabbitMQ's ``message_id``,
  JetStream's ``Nats-Msg-Id``; it is also in ``sqla-jobs-id``;
* ``sqla-jobs-kind``, ``sqla-jobs-queue``: the job's kind and queue;
* ``sqla-jobs-attempt``: which claim of the job this publish came from
  (1 for the first). A relay that died after publishing publishes the job again
  under the same id, perhaps with a higher attempt: deduplicate on the id only;
* ``traceparent``, ``tracestate``: the W3C trace context of the span that enqueued
  the job, when the app is instrumented (``sqla_jobs.otel``; added by ``PublishExecutor``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from ..drivers.base import Claimed

__all__ = ["HEADER_ATTEMPT", "HEADER_ID", "HEADER_KIND", "HEADER_QUEUE", "BrokerUnavailable", "Outgoing", "Target",
           "outgoing"]

HEADER_ID = "sqla-jobs-id"
HEADER_KIND = "sqla-jobs-kind"
HEADER_QUEUE = "sqla-jobs-queue"
HEADER_ATTEMPT = "sqla-jobs-attempt"

# One encoder for every message: json.dumps with non-default options builds a new encoder per call,
# which was a tenth of the relay's publishing time.
_stdlib_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _stdlib_body(payload: object) -> bytes:
    return _stdlib_encode(payload).encode()


try:  # orjson (the relay extras install it) writes the same compact UTF-8 JSON some ten times faster
    import orjson
except ImportError:  # pragma: no cover - the relay's extras bring it
    _body = _stdlib_body
else:

    def _body(payload: object) -> bytes:
        try:
            return orjson.dumps(payload)
        except (TypeError, orjson.JSONEncodeError):  # an integer over 64 bits: the standard library's JSON
            return _stdlib_body(payload)


class BrokerUnavailable(Exception):
    """The broker cannot be reached or stopped answering: the whole batch waits, no attempt is counted."""


@dataclass(slots=True)
class Outgoing:
    """One job on its way to the broker."""

    job: Claimed
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def message_id(self) -> str:
        return str(self.job.id)


def outgoing(job: Claimed) -> Outgoing:
    """The message for ``job``: its payload as the body, its identity in headers."""
    body = _body(job.payload)
    headers = {
        HEADER_ID: str(job.id),
        HEADER_KIND: job.kind,
        HEADER_QUEUE: job.queue,
        HEADER_ATTEMPT: str(job.attempt),
    }
    return Outgoing(job, body, headers)


class Target(Protocol):
    """A broker the relay publishes to (``RabbitMQTarget``, ``NatsTarget``).

    ``publish`` sends every message it can route and waits for the broker's
    acknowledgement of each; it returns, per job id, None for a message the
    broker acknowledged or the reason the broker refused it (unroutable, no
    stream, nack), which counts as a failed attempt. It raises
    ``BrokerUnavailable`` when the connection fails or the acknowledgements do
    not come within ``timeout``: then nothing of the batch is taken as delivered.
    """

    def route(self, kind: str) -> str | None:
        """Where jobs of ``kind`` go (for messages and logs), or None if the target has no route for it."""
        ...

    def describe(self) -> str:
        """The broker and its routes in one line, without credentials."""
        ...

    async def connect(self) -> None: ...

    async def publish(self, messages: list[Outgoing], timeout: float) -> dict[int, str | None]: ...

    async def close(self) -> None: ...


def route_for(routes: dict[str, str], kind: str) -> str | None:
    """``routes[kind]``, else the ``"*"`` route with ``{kind}`` replaced by the kind, else None."""
    if kind in routes:
        return routes[kind]
    fallback = routes.get("*")
    return fallback.replace("{kind}", kind) if fallback is not None else None
