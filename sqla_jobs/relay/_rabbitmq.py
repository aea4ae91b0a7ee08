"""``RabbitMQTarget``: publish to RabbitMQ (AMQP 0-9-1) with publisher confirms, through aio-pika.

Every message is persistent (``delivery_mode=2``), published ``mandatory`` on
a durable exchange, with ``message_id`` = the job id. The batch is published
at once and the confirms are awaited together: a message counts as delivered
only once the broker confirmed it (for a durable queue, that means written to
disk), so the relay finishes the job only then. A message no queue is bound
to receive comes back (``basic.return``) and a ``basic.nack`` is a refusal:
both count as a failed attempt of that job, never as delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import ConfigError
from ._message import BrokerUnavailable, Outgoing, route_for

__all__ = ["RabbitMQTarget"]

_EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _client() -> Any:
    try:
        import aio_pika
    except ImportError:
        raise ConfigError("RabbitMQTarget needs aio-pika: pip install 'sqla-jobs[rabbitmq]'") from None
    return aio_pika


def _properties_class() -> Any:
    """AMQP message properties, from aiormq: the AMQP layer aio-pika is built on (installed with it)."""
    import aiormq

    return aiormq.spec.Basic.Properties


class RabbitMQTarget:
    """Publish jobs to one durable exchange of a RabbitMQ server.

    ``routes`` maps a job kind to its routing key; a ``"*"`` entry is the route
    of every other kind, with ``{kind}`` replaced by the kind
    (``{"*": "jobs.{kind}"}``). ``bindings`` maps queue names to routing-key
    patterns: each queue is declared durable and bound to the exchange, so the
    messages have somewhere to go before any consumer starts.
    """

    #: ``messaging.system`` of the relay's send spans (sqla_jobs.otel).
    system = "rabbitmq"

    def __init__(
        self,
        url: str,
        *,
        routes: Mapping[str, str],
        exchange: str = "sqla_jobs",
        exchange_type: str = "topic",
        bindings: Mapping[str, str | Sequence[str]] | None = None,
    ) -> None:
        if not url.startswith(("amqp://", "amqps://")):
            raise ConfigError(f"RabbitMQ URL must start with amqp:// or amqps://, got {without_password(url)!r}")
        if not routes:
            raise ConfigError("RabbitMQTarget needs at least one route: routes={'order.created': 'orders.created'}")
        if exchange_type not in _EXCHANGE_TYPES:
            raise ConfigError(f"exchange_type must be one of {', '.join(_EXCHANGE_TYPES)}, got {exchange_type!r}")
        if not exchange:
            raise ConfigError("RabbitMQTarget needs a named exchange (the default exchange cannot be declared durable)")
        self.url = url
        self.routes = dict(routes)
        self.exchange_name = exchange
        self.exchange_type = exchange_type
        self.bindings = {q: [p] if isinstance(p, str) else list(p) for q, p in (bindings or {}).items()}
        self._connection: Any = None
        self._channel: Any = None  # aiormq's channel under aio-pika's: publishing through it costs a third less

    def route(self, kind: str) -> str | None:
        return route_for(self.routes, kind)

    def describe(self) -> str:
        routes = ", ".join(f"{k} -> {v}" for k, v in self.routes.items())
        return f"RabbitMQ {without_password(self.url)} exchange {self.exchange_name!r} ({routes})"

    async def connect(self) -> None:
        aio_pika = _client()
        await self.close()
        try:
            self._connection = await aio_pika.connect(self.url, timeout=10)
            channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.declare_exchange(
                self.exchange_name, aio_pika.ExchangeType(self.exchange_type), durable=True
            )
            for name, patterns in self.bindings.items():
                queue = await channel.declare_queue(name, durable=True)
                for pattern in patterns:
                    await queue.bind(exchange, routing_key=pattern)
            self._channel = await channel.get_underlay_channel()
        except (OSError, asyncio.TimeoutError, aio_pika.exceptions.AMQPError) as exc:
            await self.close()
            raise BrokerUnavailable(f"RabbitMQ at {without_password(self.url)}: {exc!r}") from exc

    async def publish(self, messages: list[Outgoing], timeout: float) -> dict[int, str | None]:
        aio_pika = _client()
        if self._channel is None or self._connection is None or self._connection.is_closed:
            raise BrokerUnavailable("not connected to RabbitMQ")
        # A nack raises DeliveryError, a returned (unroutable, mandatory) message PublishError, one of it.
        properties = _properties_class()
        sends = [
            self._channel.basic_publish(
                m.body, exchange=self.exchange_name, routing_key=self.route(m.job.kind) or "", mandatory=True,
                properties=properties(message_id=m.message_id, message_type=m.job.kind, content_type="application/json",
                                      delivery_mode=2, headers=dict(m.headers)),  # 2: persistent
            )
            for m in messages
        ]
        try:
            results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), timeout)
        except asyncio.TimeoutError:
            raise BrokerUnavailable(f"RabbitMQ did not confirm {len(messages)} message(s) within {timeout:g}s")
        outcome: dict[int, str | None] = {}
        for message, result in zip(messages, results, strict=True):
            if not isinstance(result, BaseException):
                outcome[message.job.id] = None
            elif isinstance(result, aio_pika.exceptions.DeliveryError):
                # Returned (no queue bound for the key) or nacked: the broker has not got it.
                outcome[message.job.id] = f"RabbitMQ refused the message: {result!r}"
            else:
                raise BrokerUnavailable(f"RabbitMQ publish failed: {result!r}") from result
        return outcome

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):  # already cut: nothing left to close
                await asyncio.wait_for(connection.close(), 5)
