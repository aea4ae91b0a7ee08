"""A dead relay's jobs go back without costing an attempt, up to ``MAX_UNCOUNTED_LOSSES`` times per job.

The relay that died is played by a claim made through the driver (the job is
``running`` under a lease no one renews), the way a SIGKILLed relay leaves it;
tests/relay/test_relay_faults.py does the same with real kills.
"""

from __future__ import annotations

import time

from sqlalchemy import update
from sqlalchemy.orm import Session

from sqla_jobs.relay import MAX_UNCOUNTED_LOSSES, Relay
from tests.conftest import Database
from tests.relay_app import RelayJob, queue

from .brokers import BrokerSpace

ROUTES = {"order.created": "stored.orders.created"}
LOST = "RelayLost: relay gone (relay or broker lost, attempt not counted)"


def claim_as_a_relay_that_dies(db: Database) -> None:
    sql = queue.driver(db.engine)
    with sql.write(db.engine) as conn:
        assert sql.claim_batch(conn, 10, "host:1:relay", "dead-relay-token", 0.5, ["relay"], False)[0]
    time.sleep(1.2)  # its lease runs out (database clock; SQLite keeps whole seconds)


def test_lost_claims_are_refunded_up_to_the_bound_then_count(relay_db: Database, space: BrokerSpace) -> None:
    with Session(relay_db.engine) as session, session.begin():
        fresh = RelayJob(kind="order.created", queue="relay", payload={"n": 1})
        worn = RelayJob(kind="order.created", queue="relay", payload={"n": 2})
        session.add_all([fresh, worn])
        session.flush()
        fresh_id, worn_id = fresh.id, worn.id
        # `worn` was already handed back MAX_UNCOUNTED_LOSSES times without its attempts counting.
        history = [{"attempt": 1, "at": "2026-01-01T00:00:00+00:00", "error": LOST}] * MAX_UNCOUNTED_LOSSES
        session.execute(update(RelayJob).where(RelayJob.id == worn_id).values(errors=history))
    claim_as_a_relay_that_dies(relay_db)

    counts = Relay(relay_db.engine, queue, space.target(ROUTES), lease=2, confirm_timeout=1).run(until_idle=True)

    assert counts.reaped == 2 and counts.published == 2
    with Session(relay_db.engine) as session:
        fresh_row, worn_row = session.get(RelayJob, fresh_id), session.get(RelayJob, worn_id)
        assert fresh_row is not None and worn_row is not None
        assert (fresh_row.state, fresh_row.attempts) == ("finished", 1)  # the lost claim was refunded
        assert (worn_row.state, worn_row.attempts) == ("finished", 2)  # past the bound: it counted
        assert "attempt not counted" not in (worn_row.errors or [])[-1]["error"]
    assert sorted(r.body["n"] for r in space.read_all(expect=2)) == [1, 2]


def test_a_job_a_workers_reaper_marked_to_run_alone_is_still_relayed(relay_db: Database, space: BrokerSpace) -> None:
    # When workers share the table, their reaper may hand back a dead relay's jobs first, by the worker's
    # rule: the job is marked `isolate` (claimed only by itself). The relay claims such a job alone.
    with Session(relay_db.engine) as session, session.begin():
        jobs = [RelayJob(kind="order.created", queue="relay", payload={"n": n}) for n in range(3)]
        session.add_all(jobs)
        session.flush()
        session.execute(update(RelayJob).where(RelayJob.id == jobs[1].id).values(isolate=True))
    counts = Relay(relay_db.engine, queue, space.target(ROUTES)).run(until_idle=True)
    assert counts.published == 3
    assert sorted(r.body["n"] for r in space.read_all(expect=3)) == [0, 1, 2]
