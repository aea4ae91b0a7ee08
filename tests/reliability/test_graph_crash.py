"""A fan-in of 10,000 -> 1 under four worker processes that are SIGKILLed and replaced, and a server restart
(issue 33, point 9): the join runs exactly once, after its last upstream finished by the database clock, and
reads all 10,000 results. On a private PostgreSQL cluster, so the restart stops nobody else's tests."""

from __future__ import annotations

import random
import signal
import time

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from tests import app
from tests.conftest import Database

from .cluster import PrivateCluster
from .conftest import Workers
from .harness import WorkerProc, effects, wait_for

# Serial: four worker processes, eight SIGKILLs and a server crash load the 2-core machine for half a minute,
# which the parallel phase's timing-bound tests (the fencing ones: a 6 s lease) must not share.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

FAN = 10_000
PROCESSES = 4


def _join_state(db: Database, join_id: int) -> str | None:
    with Session(db.engine) as session:
        return session.scalar(select(app.Job.state).where(app.Job.id == join_id))


def test_a_fan_in_of_10000_joins_once_through_sigkills_and_a_server_restart(
        private_cluster: PrivateCluster, private_db: Database, workers: Workers) -> None:
    engine = private_db.engine
    with Session(engine, expire_on_commit=False) as session, session.begin():
        # Every tenth returns its number (the finish with a result); the others take 10 ms (the batched finish),
        # so the graph runs long enough for the faults to land in it.
        ups = [app.Job(kind="result_value", payload={"value": i}) if i % 10 == 0
               else app.Job(kind="record", payload={"sleep": 0.01}) for i in range(FAN)]
        join = app.Job(kind="join", payload={}, depends_on=ups)
        session.add(join)
    running: list[WorkerProc] = [workers(private_db.url, concurrency=8) for _ in range(PROCESSES)]
    rng = random.Random(33)
    kills = restarts = 0
    deadline = time.monotonic() + 300
    while _join_state(private_db, join.id) != "finished" and time.monotonic() < deadline:
        time.sleep(0.5)
        with engine.connect() as conn:
            done = conn.scalar(select(func.count()).where(app.Job.state == "finished"))
        if kills < 8:  # a worker killed mid-batch, and another started in its place
            victim = running.pop(rng.randrange(len(running)))
            victim.signal(signal.SIGKILL)
            victim.wait(10)
            running.append(workers(private_db.url, concurrency=8))
            kills += 1
        elif restarts == 0 and done and done > FAN // 2:
            with engine.connect() as conn:
                conn.execute(text("CHECKPOINT"))
            private_cluster.stop("immediate")  # a crash, to PostgreSQL
            time.sleep(1.0)
            private_cluster.start()
            engine.dispose()
            restarts += 1
    wait_for(lambda: _join_state(private_db, join.id) == "finished", 120, "the join to finish")
    for worker in running:
        assert worker.stop() == 0, worker.log()
    assert (kills, restarts) == (8, 1), "the faults did not all happen while the graph ran"

    with Session(engine) as session:
        joined = session.get(app.Job, join.id)
        states = dict(session.execute(select(app.Job.state, func.count()).group_by(app.Job.state)).all())
        last_upstream = session.scalar(select(func.max(app.Job.finished_at)).where(app.Job.id != join.id))
        starts = effects(engine, join.id, "start")
        dead = session.scalar(select(func.count()).select_from(app.DeadJob))
        assert states == {"finished": FAN + 1} and dead == 0, states
        assert len(starts) == 1 and joined.attempts == 1, "the join ran more than once"
        assert joined.locked_at >= last_upstream, "the join was claimed before its last upstream finished"
        results = joined.result["upstreams"]
        assert len(results) == FAN
        assert results[::10] == list(range(0, FAN, 10)) and set(results) - set(range(0, FAN, 10)) <= {None}
