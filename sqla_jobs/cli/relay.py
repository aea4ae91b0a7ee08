"""``sqla-jobs relay``: publish the jobs of chosen queues to RabbitMQ or NATS JetStream (see sqla_jobs.relay).

Kept out of ``sqla_jobs.cli`` so the command's parser is one call there and the
broker clients (extras ``rabbitmq`` and ``nats``) load only when the command runs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from .._bootstrap import load_app, make_engine
from ..errors import ConfigError
from ..worker.process import freeze_startup_heap
from ..worker.signals import stop_signals

__all__ = ["add_relay_parser"]


def add_relay_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("relay", help="publish the jobs of chosen queues to RabbitMQ or NATS JetStream, "
                                     "finishing each after the broker's ack")
    common(p)
    p.add_argument("--queue", dest="queues", action="append", metavar="NAME",
                   help="a queue whose jobs the relay publishes (repeat for more; default: relay)")
    broker = p.add_mutually_exclusive_group()
    broker.add_argument("--rabbitmq", metavar="URL", default=os.environ.get("SQLA_JOBS_RABBITMQ_URL"),
                        help="AMQP URL, e.g. amqp://user:password@host:5672/vhost (env SQLA_JOBS_RABBITMQ_URL, "
                             "which keeps the password out of `ps`)")
    broker.add_argument("--nats", metavar="URL", default=os.environ.get("SQLA_JOBS_NATS_URL"),
                        help="NATS URL, e.g. nats://host:4222 (env SQLA_JOBS_NATS_URL)")
    p.add_argument("--route", action="append", default=[], metavar="KIND=DEST",
                   help="send jobs of KIND to routing key / subject DEST (repeat; KIND * is every other kind, "
                        "{kind} in DEST is replaced by the kind)")
    p.add_argument("--exchange", default="sqla_jobs", help="RabbitMQ: the durable exchange to publish to")
    p.add_argument("--exchange-type", default="topic", choices=("topic", "direct", "fanout", "headers"),
                   help="RabbitMQ: the exchange's type when the relay declares it")
    p.add_argument("--bind", action="append", default=[], metavar="QUEUE=PATTERN",
                   help="RabbitMQ: declare durable QUEUE bound to the exchange with PATTERN (repeat)")
    p.add_argument("--stream", metavar="NAME", help="NATS: create this JetStream stream if it does not exist")
    p.add_argument("--stream-subject", action="append", default=[], metavar="SUBJECT",
                   help="NATS: a subject of --stream (repeat; default: the routes' subjects)")
    p.add_argument("--batch", type=int, default=1000, help="jobs claimed and published per round")
    p.add_argument("--lease", type=float, default=60.0,
                   help="seconds a claim is held; a killed relay's jobs are published again after it")
    p.add_argument("--confirm-timeout", type=float, default=15.0,
                   help="seconds to wait for the broker's acks before the batch counts as not delivered")
    p.add_argument("--name", default="relay", help="this relay's name in locked_by and the logs")
    p.add_argument("--no-listen", action="store_true",
                   help="PostgreSQL: do not LISTEN for new jobs, only poll (for PgBouncer in transaction mode)")
    p.add_argument("--until-idle", action="store_true", help="exit once no job of the queues is due")
    p.set_defaults(func=cmd_relay)


def _pairs(values: list[str], option: str, example: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{option} {raw!r}: expected {example}")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def target_from(args: argparse.Namespace) -> Any:
    from ..relay import NatsTarget, RabbitMQTarget

    if not (args.rabbitmq or args.nats):
        raise ConfigError("sqla-jobs relay needs a broker: --rabbitmq URL (or SQLA_JOBS_RABBITMQ_URL) "
                          "or --nats URL (or SQLA_JOBS_NATS_URL)")
    routes = _pairs(args.route, "--route", "KIND=DEST, e.g. --route order.created=orders.created")
    twice = sorted(kind for kind, dests in routes.items() if len(dests) > 1)
    if twice:
        raise ConfigError(f"--route gives kind(s) {', '.join(twice)} more than one destination; give each one")
    if not routes:
        raise ConfigError("sqla-jobs relay needs at least one --route KIND=DEST (e.g. --route order.created=orders)")
    single = {kind: dests[0] for kind, dests in routes.items()}
    if args.rabbitmq:
        if args.stream or args.stream_subject:
            raise ConfigError("--stream and --stream-subject are for --nats; with --rabbitmq use --bind")
        bindings = _pairs(args.bind, "--bind", "QUEUE=PATTERN, e.g. --bind orders=orders.#")
        return RabbitMQTarget(args.rabbitmq, routes=single, exchange=args.exchange,
                              exchange_type=args.exchange_type, bindings=bindings)
    if args.bind:
        raise ConfigError("--bind is for --rabbitmq; with --nats use --stream and --stream-subject")
    return NatsTarget(args.nats, routes=single, stream=args.stream, subjects=args.stream_subject)


def cmd_relay(args: argparse.Namespace) -> int:
    from ..relay import Relay

    # First: a SIGTERM/SIGINT while starting up is a stop too, not a kill (it is seen once the relay exists).
    signals = stop_signals()
    target = target_from(args)  # bad options fail before anything connects
    app = load_app(args.app)
    engine = make_engine(args.url, pool_size=2)
    app.check_schema(engine)
    relay = Relay(engine, app, target, queues=args.queues or ["relay"], batch=args.batch, lease=args.lease,
                  confirm_timeout=args.confirm_timeout, name=args.name, listen=not args.no_listen)
    if signals is not None:  # a second signal exits at once; the jobs in flight go out again after their lease
        signals.attach(f"relay {relay.name}", relay.stop)
    freeze_startup_heap()  # the collector's rounds over the start-up heap were a sixth of a relay's time to NATS
    try:
        counts = relay.run(until_idle=args.until_idle)
    finally:
        engine.dispose()
    print(f"relay {relay.name}: published {counts.published}, refused {counts.refused}, "
          f"unrouted {counts.unrouted}, interrupted {counts.interrupted}, reaped {counts.reaped}, "
          f"reconnects {counts.reconnects}")
    return 0
