"""The relay on every backend and both brokers: what arrives, what it carries, what fails and how."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import JobEvent, Worker
from sqla_jobs.errors import ConfigError
from sqla_jobs.relay import HEADER_ATTEMPT, HEADER_ID, HEADER_KIND, HEADER_QUEUE, Relay
from sqla_jobs.testing import make_due
from tests.conftest import Database, run_cli
from tests.relay_app import RelayDeadJob, RelayJob, queue

from .brokers import BrokerSpace, require
from .conftest import wait_for

ROUTES = {"order.created": "stored.orders.created", "order.paid": "stored.orders.paid"}


def states(db: Database) -> dict[str, int]:
    with Session(db.engine) as session:
        rows = session.execute(select(RelayJob.state, func.count()).group_by(RelayJob.state))
        return {state: n for state, n in rows}


def dead_count(db: Database) -> int:
    with Session(db.engine) as session:
        return session.scalar(select(func.count()).select_from(RelayDeadJob)) or 0


def test_each_committed_job_arrives_with_its_id_kind_and_payload(relay_db: Database, space: BrokerSpace) -> None:
    # The enqueue side is the ordinary one: a Job added in the business transaction.
    with Session(relay_db.engine) as session, session.begin():
        for n in range(30):
            kind = "order.created" if n % 3 else "order.paid"
            session.add(RelayJob(kind=kind, queue="relay", payload={"order": n, "note": "café"}))
    with Session(relay_db.engine) as session:  # a business transaction that rolls back publishes nothing
        session.add(RelayJob(kind="order.created", queue="relay", payload={"order": -1}))
        session.flush()
        session.rollback()
    with Session(relay_db.engine) as session:
        expected = {str(j.id): j for j in session.scalars(select(RelayJob))}

    counts = Relay(relay_db.engine, queue, space.target(ROUTES), batch=7).run(until_idle=True)

    assert counts.published == 30
    received = space.read_all(expect=30)
    assert sorted(r.message_id for r in received) == sorted(expected)  # each once, nothing else
    for message in received:
        job = expected[message.message_id]
        assert message.body == job.payload
        assert message.headers[HEADER_ID] == message.message_id
        assert message.headers[HEADER_KIND] == job.kind
        assert message.headers[HEADER_QUEUE] == "relay"
        assert message.headers[HEADER_ATTEMPT] == "1"
        assert message.destination == space.dest(ROUTES[job.kind])
        if space.broker == "rabbitmq":  # persistent, typed JSON
            assert message.properties == {"type": job.kind, "content_type": "application/json", "delivery_mode": 2}
    assert states(relay_db) == {"finished": 30}


def test_the_relay_takes_only_its_queues(relay_db: Database, space: BrokerSpace) -> None:
    with Session(relay_db.engine) as session, session.begin():
        session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 1}))
        session.add(RelayJob(kind="order.created", queue="other", payload={"n": 2}))
    Relay(relay_db.engine, queue, space.target(ROUTES)).run(until_idle=True)
    assert [r.body for r in space.read_all(expect=1)] == [{"n": 1}]
    assert states(relay_db) == {"finished": 1, "pending": 1}


@pytest.mark.parametrize("problem", ["no route", "broker refuses"])
def test_a_job_the_broker_cannot_take_fails_like_a_handler_and_ends_dead(
    relay_db: Database, space: BrokerSpace, problem: str
) -> None:
    # "no route": the target maps no destination to the kind. "broker refuses": the destination exists
    # in the config but no queue is bound to it (RabbitMQ returns the mandatory message) or no stream
    # stores the subject (JetStream: no responders). Either way the broker does not have the message:
    # the job is not finished; it fails an attempt, waits the app's backoff and ends in the dead letters.
    routes = dict(ROUTES, **({"order.paid": "nowhere.paid"} if problem == "broker refuses" else {}))
    if problem == "no route":
        del routes["order.paid"]
    with Session(relay_db.engine) as session, session.begin():
        session.add(RelayJob(kind="order.paid", queue="relay", payload={"n": 1}, max_attempts=2))
        session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 2}))
    heard: list[tuple[str, str, int]] = []

    def hear(event: JobEvent) -> None:
        heard.append((event.name, event.kind, event.attempt))

    for name in ("finished", "failed", "dead_letter"):
        queue.on(name)(hear)
    try:
        relay = Relay(relay_db.engine, queue, space.target(routes))
        relay.run(until_idle=True)  # first attempt fails, the retry waits 0.2 s (the app's backoff)
        assert states(relay_db) == {"finished": 1, "pending": 1}
        time.sleep(0.5)
        relay.run(until_idle=True)
    finally:
        for name in ("finished", "failed", "dead_letter"):
            queue.off(name, hear)
    # The app's hooks hear the relay's outcomes as they hear a worker's (Prometheus counters included).
    assert sorted(heard) == [("dead_letter", "order.paid", 2), ("failed", "order.paid", 1),
                             ("finished", "order.created", 1)]
    assert states(relay_db) == {"finished": 1}
    assert dead_count(relay_db) == 1
    with Session(relay_db.engine) as session:
        dead = session.scalars(select(RelayDeadJob)).one()
    assert dead.kind == "order.paid"
    assert ("no route for kind 'order.paid'" if problem == "no route" else "refused" if space.broker == "rabbitmq"
            else "no JetStream stream stores subject") in (dead.last_error or "")
    assert [r.body for r in space.read_all(expect=1)] == [{"n": 2}]


def test_bad_relay_settings_are_refused_with_what_to_do(space: BrokerSpace) -> None:
    from sqla_jobs.relay import NatsTarget, RabbitMQTarget

    with pytest.raises(ConfigError, match="at least one route"):
        RabbitMQTarget(space.url, routes={}) if space.broker == "rabbitmq" else NatsTarget(space.url, routes={})
    with pytest.raises(ConfigError, match="amqp://"):
        RabbitMQTarget("http://guest:secret@host/", routes={"a": "b"})
    with pytest.raises(ConfigError, match="half the lease"):
        Relay(None, queue, space.target(ROUTES), lease=10, confirm_timeout=6)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="queue names"):
        Relay(None, queue, space.target(ROUTES), queues="relay")  # type: ignore[arg-type]


def test_cli_refuses_bad_options_before_connecting(relay_db: Database) -> None:
    env = relay_db.env()
    base = ["relay", "--app", "tests.relay_app:queue"]
    cases = [
        ([], "needs a broker"),
        (["--rabbitmq", "amqp://guest:guest@127.0.0.1:5672/"], "at least one --route"),
        (["--nats", "nats://127.0.0.1:4222", "--route", "order.created"], "expected KIND=DEST"),
        (["--nats", "nats://127.0.0.1:4222", "--route", "a=x", "--bind", "q=x"], "--bind is for --rabbitmq"),
        (["--rabbitmq", "amqp://guest:guest@127.0.0.1:5672/", "--route", "a=x", "--route", "a=y"],
         "more than one destination"),
    ]
    for options, message in cases:
        result = run_cli(*base, *options, env={k: v for k, v in env.items() if "RABBITMQ" not in k and "NATS" not in k})
        assert result.returncode == 2, (options, result.stderr)
        assert message in result.stderr
        assert "secret" not in result.stderr


def test_cli_relays_until_idle(relay_db: Database, space: BrokerSpace) -> None:
    with Session(relay_db.engine) as session, session.begin():
        session.add_all(RelayJob(kind="order.created", queue="relay", payload={"n": n}) for n in range(20))
    result = run_cli("relay", "--app", "tests.relay_app:queue", *space.cli_options(ROUTES), "--until-idle",
                     env=relay_db.env())
    assert result.returncode == 0, result.stderr
    assert "published 20" in result.stdout
    assert "guest:guest" not in result.stderr  # the log names the broker without its password
    assert sorted(r.body["n"] for r in space.read_all(expect=20)) == list(range(20))
    assert json.dumps(states(relay_db)) == json.dumps({"finished": 20})


def test_the_relay_leaves_its_start_up_heap_out_of_the_collectors_rounds(
        relay_pg: Database, space: BrokerSpace, tmp_path: Path) -> None:
    """``sqla-jobs relay`` freezes what start-up built, as ``sqla-jobs worker`` does: the collector's rounds over
    it were a sixth of a relay's time to NATS (docs/performance.md). The app reports from the relay's process."""
    with Session(relay_pg.engine) as session, session.begin():
        session.add_all(RelayJob(kind="order.created", queue="relay", payload={"n": n}) for n in range(200))
    report = tmp_path / "heap.json"
    result = run_cli("relay", "--app", "tests.relay_heap_app:queue", *space.cli_options(ROUTES), "--until-idle",
                     env={**relay_pg.env(), "SQLA_JOBS_TEST_HEAP_REPORT": str(report)})
    assert result.returncode == 0, result.stderr
    assert "published 200" in result.stdout
    assert report.exists(), "no collection ran after a freeze: the relay did not freeze its start-up heap"
    assert json.loads(report.read_text()) == {"queue_scanned": False}


def test_on_postgresql_an_idle_relay_wakes_when_a_job_is_enqueued(relay_pg: Database, space: BrokerSpace) -> None:
    # With a 60 s poll interval, only the LISTEN/NOTIFY wake-up can bring the job out within the wait below.
    relay = Relay(relay_pg.engine, queue, space.target(ROUTES), poll_interval=60, lease=60)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        time.sleep(2)  # connected, found nothing, asleep
        with Session(relay_pg.engine) as session, session.begin():
            session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 7}))
        wait_for(lambda: states(relay_pg) == {"finished": 1}, 15, "the relay to wake and publish the job")
    finally:
        relay.stop()
        thread.join(30)
    assert [r.body for r in space.read_all(expect=1)] == [{"n": 7}]


def test_a_payload_at_the_size_limit(relay_db: Database, space: BrokerSpace) -> None:
    # sqla-jobs takes payloads up to 1 MiB; NATS' default max_payload is 1 MiB for body and headers together.
    # RabbitMQ takes it. NATS refuses that one message: it fails alone (here its only attempt, so it ends
    # dead) while the jobs of the same batch arrive: no outage, no refund loop for the batch.
    big = {"blob": "x" * (1_048_576 - 20)}
    with Session(relay_db.engine) as session, session.begin():
        session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 1}))
        session.add(RelayJob(kind="order.created", queue="relay", payload=big, max_attempts=1))
        session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 3}))
    counts = Relay(relay_db.engine, queue, space.target(ROUTES)).run(until_idle=True)
    bodies = space.read_all(expect=3 if space.broker == "rabbitmq" else 2)
    if space.broker == "rabbitmq":
        assert counts.published == 3 and big in [r.body for r in bodies]
        assert states(relay_db) == {"finished": 3}
    else:
        assert (counts.published, counts.refused, counts.interrupted) == (2, 1, 0)
        assert sorted(r.body["n"] for r in bodies) == [1, 3]
        with Session(relay_db.engine) as session:
            dead = session.scalars(select(RelayDeadJob)).one()
        assert "larger than the NATS server's max_payload" in (dead.last_error or "")


def test_a_worker_that_takes_a_relayed_job_by_mistake_puts_it_back_unharmed(
    relay_db: Database, space: BrokerSpace
) -> None:
    with Session(relay_db.engine) as session, session.begin():
        session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 1}))
    Worker(relay_db.engine, queue, concurrency=1, poll_interval=0.05).run(burst=True, install_signals=False)
    with Session(relay_db.engine) as session:
        job = session.scalars(select(RelayJob)).one()
        assert (job.state, job.attempts, job.last_error) == ("pending", 0, None)  # snoozed: nothing spent
    assert make_due(relay_db.engine, queue) == 1
    Relay(relay_db.engine, queue, space.target(ROUTES)).run(until_idle=True)
    assert [r.body for r in space.read_all(expect=1)] == [{"n": 1}]
    assert states(relay_db) == {"finished": 1}


def test_a_message_jetstream_refuses_fails_alone_with_jetstreams_reason(relay_pg: Database) -> None:
    # The stream takes messages of at most 200 bytes: JetStream answers the bigger one with an API error
    # (code 400, "message size exceeds maximum allowed"), a refusal of that message and not an outage: it
    # fails like a handler (here its only attempt, so it ends dead) while the rest of its batch is stored.
    require("nats")
    space = BrokerSpace("nats")
    try:
        asyncio.run(_stream_with_max_msg_size(space, 200))
        with Session(relay_pg.engine) as session, session.begin():
            session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 1}))
            session.add(RelayJob(kind="order.created", queue="relay", payload={"blob": "x" * 500}, max_attempts=1))
            session.add(RelayJob(kind="order.created", queue="relay", payload={"n": 3}))
        counts = Relay(relay_pg.engine, queue, space.target(ROUTES)).run(until_idle=True)
        assert (counts.published, counts.refused, counts.interrupted) == (2, 1, 0)
        assert sorted(r.body["n"] for r in space.read_all(expect=2)) == [1, 3]
        with Session(relay_pg.engine) as session:
            dead = session.scalars(select(RelayDeadJob)).one()
        assert "JetStream refused the message" in (dead.last_error or "")
        assert "message size exceeds maximum allowed" in (dead.last_error or "")
    finally:
        space.delete()


async def _stream_with_max_msg_size(space: BrokerSpace, size: int) -> None:
    """The test's stream made beforehand with a size limit (the relay finds it and leaves it as it is)."""
    import nats

    nc = await nats.connect(space.url)
    try:
        await nc.jetstream().add_stream(name=space.name, subjects=[f"{space.prefix}.stored.>"], max_msg_size=size)
    finally:
        await nc.close()


def test_a_stream_that_cannot_store_now_interrupts_the_batch_instead_of_failing_its_jobs() -> None:
    # A full stream that discards new messages answers 503 ("maximum messages exceeded"): JetStream cannot
    # store now, which says nothing against the message. The batch is not delivered (BrokerUnavailable: the
    # relay refunds it and tries again later) rather than one job failing for the stream's state.
    require("nats")
    space = BrokerSpace("nats")
    try:
        asyncio.run(_publish_to_a_full_stream(space))
    finally:
        space.delete()


async def _publish_to_a_full_stream(space: BrokerSpace) -> None:
    import nats
    from nats.js.api import DiscardPolicy

    from sqla_jobs.drivers.base import Claimed
    from sqla_jobs.relay._message import BrokerUnavailable, outgoing

    nc = await nats.connect(space.url)
    try:
        await nc.jetstream().add_stream(name=space.name, subjects=[f"{space.prefix}.stored.>"], max_msgs=1,
                                        discard=DiscardPolicy.NEW)
    finally:
        await nc.close()
    target = space.target(ROUTES)
    await target.connect()
    try:
        first = outgoing(Claimed(1, "order.created", "relay", {"n": 1}, 1, 5, 0, "t1"))
        assert await target.publish([first], 5.0) == {1: None}  # stored: the stream is now full
        second = outgoing(Claimed(2, "order.created", "relay", {"n": 2}, 1, 5, 0, "t2"))
        with pytest.raises(BrokerUnavailable, match="maximum messages exceeded"):
            await target.publish([second], 5.0)
    finally:
        await target.close()


def test_a_relayed_jobs_dependents_unblock_when_the_broker_took_it(relay_db: Database, space: BrokerSpace) -> None:
    """A relayed job ends like a handled one: its finish (the broker's ack) counts its dependents down in
    the same transaction, so a chain of relayed jobs goes out link by link (each blocked until then)."""
    with Session(relay_db.engine, expire_on_commit=False) as session, session.begin():
        chain = [RelayJob(kind="order.created", queue="relay", payload={"step": 0})]
        for step in range(1, 4):
            chain.append(RelayJob(kind="order.paid", queue="relay", payload={"step": step}, depends_on=[chain[-1]]))
        session.add_all(chain)
    assert states(relay_db) == {"pending": 1, "blocked": 3}

    counts = Relay(relay_db.engine, queue, space.target(ROUTES), batch=7).run(until_idle=True)

    assert counts.published == 4
    received = space.read_all(expect=4)
    assert sorted(r.body["step"] for r in received) == [0, 1, 2, 3]
    assert states(relay_db) == {"finished": 4}
