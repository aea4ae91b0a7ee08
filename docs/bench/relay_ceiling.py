"""The broker client's own ceiling for the relay's messages: no database, no relay (manual, not a test).

Publishes ``--messages`` messages exactly as the relay sends them (the same
subject or routing key, the same headers and dedup id, a body of the same
size, the same persistence and confirm options) through the same client
library the relay uses, and times from the first publish to the last
acknowledgement (connecting and declaring the stream or exchange are not
timed). Prints messages/s per broker::

    python docs/bench/relay_ceiling.py [--brokers rabbitmq,nats] [--messages 20000] [--window 0] [--runs 1]

* NATS JetStream: nats-py's ``publish_async`` (one reply subscription for all
  acks, no request/timer per message), ``Nats-Msg-Id`` = the id, file storage;
  every PubAck awaited.
* RabbitMQ: aiormq's ``basic_publish`` on a channel with publisher confirms,
  ``delivery_mode=2``, ``mandatory``, ``message_id``/``type``/``content_type``
  and the relay's headers, to a durable topic exchange bound to a durable
  queue; every confirm awaited.

``--window``: most messages awaiting their ack at once (0: all of them, the
client's best on this machine). ``docs/bench/relay.py`` runs this in the same
run as the relay and prints the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from sqla_jobs.relay import HEADER_ATTEMPT, HEADER_ID, HEADER_KIND, HEADER_QUEUE
from tests.relay.brokers import BrokerSpace

KIND, QUEUE = "order.created", "relay"
ROUTES = {KIND: "stored.orders.created"}  # what docs/bench/relay.py routes its jobs to


def messages(count: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """(message id, body, headers) of ``count`` jobs as the relay builds them for relay.py's payloads."""
    built = []
    for n in range(count):
        job_id = str(n + 1)
        body = json.dumps({"order": n}, separators=(",", ":"), ensure_ascii=False).encode()
        built.append((job_id, body, {HEADER_ID: job_id, HEADER_KIND: KIND, HEADER_QUEUE: QUEUE, HEADER_ATTEMPT: "1"}))
    return built


async def _nats(space: BrokerSpace, built: list[tuple[str, bytes, dict[str, str]]], window: int) -> float:
    import nats

    target = space.target(ROUTES)
    await target.connect()  # the relay's own set-up: the stream, file storage, the same duplicate window
    await target.close()
    subject = target.route(KIND)
    nc = await nats.connect(space.url)
    try:
        js = nc.jetstream(publish_async_max_pending=window or len(built))
        started = time.perf_counter()
        pending = [await js.publish_async(subject, body, headers={"Nats-Msg-Id": mid, **headers})
                   for mid, body, headers in built]
        acks = await asyncio.gather(*pending, return_exceptions=True)
        took = time.perf_counter() - started
    finally:
        await nc.close()
    _check(acks)
    return len(built) / took


async def _rabbitmq(space: BrokerSpace, built: list[tuple[str, bytes, dict[str, str]]], window: int) -> float:
    import aio_pika
    import aiormq

    target = space.target(ROUTES)
    await target.connect()  # the relay's own set-up: durable exchange, durable queue, binding
    await target.close()
    routing_key = target.route(KIND)
    connection = await aio_pika.connect(space.url)
    try:
        confirming = await connection.channel(publisher_confirms=True, on_return_raises=True)
        channel = await confirming.get_underlay_channel()  # aiormq's, as the relay publishes
        properties = aiormq.spec.Basic.Properties
        gate = asyncio.Semaphore(window or len(built))

        async def send(mid: str, body: bytes, headers: dict[str, str]) -> Any:
            async with gate:
                return await channel.basic_publish(
                    body, exchange=space.name, routing_key=routing_key, mandatory=True,
                    properties=properties(message_id=mid, message_type=KIND, content_type="application/json",
                                          delivery_mode=2, headers=dict(headers)))

        started = time.perf_counter()
        acks = await asyncio.gather(*(send(*m) for m in built), return_exceptions=True)
        took = time.perf_counter() - started
    finally:
        await connection.close()
    _check(acks)
    return len(built) / took


def _check(acks: list[Any]) -> None:
    failed = [a for a in acks if isinstance(a, BaseException)]
    if failed:
        raise SystemExit(f"{len(failed)} message(s) not acknowledged, first: {failed[0]!r}")


def ceiling(broker: str, count: int, window: int = 0) -> float:
    """Acknowledged messages/s of one run of ``count`` messages to ``broker`` (its own stream or exchange)."""
    space = BrokerSpace(broker)
    built = messages(count)
    gc.collect()  # the same heap as the relay's run: start-up objects frozen (docs/bench/relay.py)
    gc.freeze()
    try:
        return asyncio.run((_rabbitmq if broker == "rabbitmq" else _nats)(space, built, window))
    finally:
        space.delete()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--brokers", default="rabbitmq,nats")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--window", type=int, default=0, help="most unacknowledged messages at once (0: all)")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    brokers = [b for b in args.brokers.split(",") if b]
    results: dict[str, list[float]] = {b: [] for b in brokers}
    for run in range(args.runs):
        for broker in brokers if run % 2 == 0 else reversed(brokers):
            rate = ceiling(broker, args.messages, args.window)
            results[broker].append(rate)
            print(f"  run {run + 1} {broker:8s} {rate:8.0f} msgs/s", flush=True)
    for broker, rates in results.items():
        runs = ", ".join(f"{r:.0f}" for r in rates)
        print(f"{broker:8s} median {statistics.median(rates):8.0f} msgs/s  (runs: {runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
