"""The real brokers the relay tests publish to, and readers that take every message back out.

RabbitMQ at 127.0.0.1:5672 (guest/guest) and NATS with JetStream at
127.0.0.1:4222, started by `.ci/run` like PostgreSQL (override with
``SQLA_JOBS_TEST_RABBITMQ_URL`` / ``SQLA_JOBS_TEST_NATS_URL``). Each test
declares its own exchange and queue, or its own stream, and deletes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import IN_CI

RABBITMQ_URL = os.environ.get("SQLA_JOBS_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("SQLA_JOBS_TEST_NATS_URL", "nats://127.0.0.1:4222")
BROKERS = ("rabbitmq", "nats")


def _answers(url: str) -> str | None:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=3).close()
        return None
    except OSError as exc:
        return str(exc)


def require(broker: str) -> None:
    url = RABBITMQ_URL if broker == "rabbitmq" else NATS_URL
    problem = _answers(url)
    if problem:
        if IN_CI:
            pytest.fail(f"{broker} is required in CI but does not answer at {url}: {problem}")
        pytest.skip(f"{broker} does not answer at {url}: {problem}")


@dataclass
class Received:
    """One message as a consumer got it."""

    message_id: str
    headers: dict[str, str]
    body: Any
    destination: str  # routing key or subject
    #: RabbitMQ's message properties that the relay sets (none for NATS).
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class BrokerSpace:
    """A test's own corner of a broker: its exchange and queue, or its stream."""

    broker: str
    name: str = field(default_factory=lambda: f"relay_test_{uuid.uuid4().hex[:10]}")

    @property
    def url(self) -> str:
        return RABBITMQ_URL if self.broker == "rabbitmq" else NATS_URL

    @property
    def prefix(self) -> str:
        """Routing keys / subjects of this test start with it."""
        return self.name

    def dest(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"

    def target(self, routes: dict[str, str], url: str | None = None) -> Any:
        from sqla_jobs.relay import NatsTarget, RabbitMQTarget

        full = {kind: self.dest(d) for kind, d in routes.items()}
        if self.broker == "rabbitmq":
            return RabbitMQTarget(url or self.url, routes=full, exchange=self.name,
                                  bindings={self.name: f"{self.prefix}.stored.#"})
        return NatsTarget(url or self.url, routes=full, stream=self.name, subjects=[f"{self.prefix}.stored.>"])

    def cli_options(self, routes: dict[str, str], url: str | None = None) -> list[str]:
        options = [f"--{self.broker}", url or self.url]
        for kind, d in routes.items():
            options += ["--route", f"{kind}={self.dest(d)}"]
        if self.broker == "rabbitmq":
            return [*options, "--exchange", self.name, "--bind", f"{self.name}={self.prefix}.stored.#"]
        return [*options, "--stream", self.name, "--stream-subject", f"{self.prefix}.stored.>"]

    def read_all(self, expect: int, idle: float = 3.0) -> list[Received]:
        """Every message stored for this test: stops ``idle`` seconds after the last one (or after ``expect``)."""
        reader = _read_rabbitmq if self.broker == "rabbitmq" else _read_nats
        return asyncio.run(reader(self, expect, idle))

    def delete(self) -> None:
        asyncio.run(_delete_rabbitmq(self) if self.broker == "rabbitmq" else _delete_nats(self))

    def cut_connections(self, proxy: Any = None, relay: Any = None) -> None:
        """Cut the relay's broker connection: RabbitMQ closes it from the server side; NATS through ``proxy``.

        RabbitMQ closes only the connections of the ``relay`` process (found by their client ports), so
        relay tests running side by side (``pytest -n 4``) keep theirs. ``rabbitmqctl`` takes
        seconds to start, long enough for a fast relay to finish its work first; the relay is
        paused meanwhile (SIGSTOP/SIGCONT: a slow process, not a dead one), so the cut lands while
        it still has jobs to publish.
        """
        if self.broker == "rabbitmq":
            assert relay is not None, "RabbitMQ cuts the connections of one relay process"
            # Through the handle, not os.kill(pid): a relay that already exited no longer owns its pid.
            relay.send_signal(signal.SIGSTOP)
            try:
                _close_rabbitmq_connections_of(relay.pid)
            finally:
                relay.send_signal(signal.SIGCONT)
        else:
            assert proxy is not None, "NATS connections are cut through a TcpProxy"
            proxy.cut()


def _client_ports(pid: int, server_port: int) -> set[int]:
    """The local ports of process ``pid``'s TCP connections to ``server_port`` (from ``ss``)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "dport", f"= :{server_port}"],
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return {int(line.split()[2].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}


def _close_rabbitmq_connections_of(pid: int) -> None:
    ports = _client_ports(pid, urlsplit(RABBITMQ_URL).port or 5672)
    assert ports, f"process {pid} has no connection to RabbitMQ to cut"
    listed = subprocess.run(["rabbitmqctl", "list_connections", "pid", "peer_port", "--no-table-headers", "-q"],
                            check=True, capture_output=True, text=True, timeout=60).stdout
    theirs = [line.split()[0] for line in listed.splitlines() if line.split()[-1:] and
              line.split()[-1].isdigit() and int(line.split()[-1]) in ports]
    assert theirs, f"RabbitMQ lists no connection from ports {ports}: {listed}"
    for connection in theirs:
        subprocess.run(["rabbitmqctl", "close_connection", connection, "relay test cuts the connection"],
                       check=True, capture_output=True, timeout=60)


async def _read_rabbitmq(space: BrokerSpace, expect: int, idle: float) -> list[Received]:
    import aio_pika

    got: list[Received] = []
    connection = await aio_pika.connect(space.url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2000)
        queue = await channel.declare_queue(space.name, durable=True, passive=True)
        async with queue.iterator(no_ack=True) as messages:
            while True:
                wait = 0.5 if len({r.message_id for r in got}) >= expect else idle
                try:
                    message = await asyncio.wait_for(messages.__anext__(), wait)
                except asyncio.TimeoutError:
                    break
                headers = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in message.headers.items()}
                properties = {"type": message.type, "content_type": message.content_type,
                              "delivery_mode": int(message.delivery_mode)}
                got.append(Received(str(message.message_id), headers, json.loads(message.body),
                                    message.routing_key or "", properties))
    return got


async def _read_nats(space: BrokerSpace, expect: int, idle: float) -> list[Received]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    got: list[Received] = []
    nc = await nats.connect(space.url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(f"{space.prefix}.>", stream=space.name,
                                      config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                            deliver_policy=DeliverPolicy.ALL))
        while True:
            wait = 0.5 if len({r.message_id for r in got}) >= expect else idle
            try:
                batch = await sub.fetch(1000, timeout=wait)
            except (TimeoutError, asyncio.TimeoutError, nats.errors.TimeoutError):
                break
            for msg in batch:
                headers = dict(msg.headers or {})
                got.append(Received(headers.get("Nats-Msg-Id", ""), headers, json.loads(msg.data), msg.subject))
    finally:
        await nc.close()
    return got


async def _delete_rabbitmq(space: BrokerSpace) -> None:
    import aio_pika

    connection = await aio_pika.connect(space.url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(space.name)
        await channel.exchange_delete(space.name)


async def _delete_nats(space: BrokerSpace) -> None:
    import nats

    nc = await nats.connect(space.url)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await nc.jetstream().delete_stream(space.name)
    finally:
        await nc.close()
