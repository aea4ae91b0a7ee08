"""A hypothesis state machine over random job graphs, against the real database, through the production paths.

Rules: add a few jobs with random upstreams (new jobs of the same flush, or any job seen so far, dead and
purged ones included) and random failure policies, through the ORM; claim (the worker's claim); finish a
running job, or all of them at once (``Store.finish_and_claim``: PostgreSQL's hot statement and its
transactional fallback); fail
one for good (the outcome policy's ``settle``: a dead letter); cancel a waiting job (``queue.cancel``);
requeue a dead job; purge the dead letters; make a batch of new members with random callbacks, or add members
to a batch made earlier (refused once a callback has left ``blocked``). A small model says what each step must
do. After every step:

* every job's state, and a blocked job's count of upstreams it still waits for, match the model;
* a claim returns exactly the jobs whose upstreams all finished (or were passed on as the policy says):
  no job ever starts before them, and none is ever claimed while it runs;
* a bad graph raises ``InvalidJob`` at flush and writes nothing;
* each batch callback is released once (an on_failure callback skipped, ``cancelled``, when no member failed).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from sqla_jobs import Batch, InvalidJob
from sqla_jobs.drivers.base import Claimed
from sqla_jobs.worker.outcomes import settle
from sqla_jobs.worker.runs import Outcome
from sqla_jobs.worker.store import Store
from tests import app
from tests.conftest import Database

pytestmark = pytest.mark.slow

POLICIES = (None, "cancel", "run", "wait")
#: How an upstream ended, as the dependents hear it, and what each policy then does.
_ACTION = {(policy, how): "run" for policy in ("run", "errback") for how in ("dead", "cancelled", "purged")} | {
    ("wait", "dead"): "wait"}
#: A batch's callbacks and the policies they get (sqla_jobs._batch).
CALLBACKS = {"on_complete": "run", "on_success": "wait", "on_failure": "errback"}


@dataclass
class Node:
    state: str  # blocked | pending | running | finished | cancelled | dead | purged
    policy: str | None
    ups: list[int]
    waiting: set[int] = field(default_factory=set)  # upstreams whose end it still waits for
    claims: int = 0
    failed: bool = False  # an upstream's failure was passed on to it as done (an on_failure callback runs)


def make_machine(db: Database) -> type[RuleBasedStateMachine]:
    engine = db.engine
    driver = app.queue.driver(engine)
    jobs, dead, edges = app.Job.__table__, app.DeadJob.__table__, driver.edges

    class GraphMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            with engine.begin() as conn:
                for table in (edges, jobs, dead, driver.batches):
                    conn.execute(delete(table))
            self.nodes: dict[int, Node] = {}
            self.running: dict[int, Claimed] = {}
            self.batches: list[tuple[int, list[int]]] = []  # (batch id, its callbacks' ids)
            self.store = Store(engine, app.queue, driver, "machine", 60.0, None)

        def teardown(self) -> None:
            self.store.close()

        # -- the model's hand-off -------------------------------------------------------------

        def dependents(self, up: int) -> list[int]:
            return [i for i, n in self.nodes.items() if n.state == "blocked" and up in n.waiting]

        def finished(self, up: int) -> None:
            self.nodes[up].state = "finished"
            for i in self.dependents(up):
                self.nodes[i].waiting.discard(up)
                self.released(i)

        def released(self, i: int) -> None:
            node = self.nodes[i]
            if not node.waiting:
                node.state = "cancelled" if node.policy == "errback" and not node.failed else "pending"

        def failed(self, ups: list[int], how: str) -> None:
            level = ups
            while level:
                cancelled: list[int] = []
                for up in level:
                    for i in self.dependents(up):
                        node = self.nodes[i]
                        action = _ACTION.get((node.policy, how), "cancel")
                        if action == "run":
                            node.waiting.discard(up)
                            node.failed = True
                            self.released(i)
                        elif action == "cancel":
                            node.state = "cancelled"
                            cancelled.append(i)
                level, how = cancelled, "cancelled"

        # -- rules ------------------------------------------------------------------------------

        @rule(specs=st.lists(st.tuples(st.lists(st.integers(0, 10_000), max_size=3), st.sampled_from(POLICIES)),
                             min_size=1, max_size=6))
        def add(self, specs: list[tuple[list[int], str | None]]) -> None:
            known = sorted(self.nodes)
            new: list[Any] = []
            wanted: list[tuple[list[Any], str | None]] = []  # upstreams (model ids, or new jobs) and policy
            bad = False
            for picks, policy in specs:
                ups: list[Any] = []
                for pick in picks:
                    choices = len(known) + len(new)
                    if not choices:
                        continue
                    k = pick % choices
                    up = known[k] if k < len(known) else new[k - len(known)]
                    if isinstance(up, int):
                        state = self.nodes[up].state
                        bad = bad or state in ("dead", "purged") or (state == "cancelled" and policy != "run")
                        bad = bad or self.nodes[up].policy == "errback"  # an on_failure callback may be skipped
                    ups.append(up)
                job = app.Job(kind="noop", payload={}, max_attempts=1, on_upstream_failure=policy, depends_on=ups)
                new.append(job)
                wanted.append((ups, policy))
            if bad:
                with pytest.raises(InvalidJob), Session(engine) as session, session.begin():
                    session.add_all(new)
                return
            with Session(engine, expire_on_commit=False) as session, session.begin():
                session.add_all(new)
            for job, (ups, policy) in zip(new, wanted, strict=True):
                ids = list(dict.fromkeys(u if isinstance(u, int) else u.id for u in ups))
                waiting = {u for u in ids if self.nodes[u].state not in ("finished", "cancelled")}
                self.nodes[job.id] = Node("blocked" if waiting else "pending", policy, ids, waiting)

        @rule(size=st.integers(1, 4), names=st.sets(st.sampled_from(sorted(CALLBACKS)), min_size=1))
        def add_batch(self, size: int, names: set[str]) -> None:
            batch = Batch(**{name: app.Job(kind="noop", payload={}, max_attempts=1) for name in sorted(names)})
            members = [app.Job(kind="noop", payload={}, max_attempts=1, batch=batch) for _ in range(size)]
            with Session(engine, expire_on_commit=False) as session, session.begin():
                session.add_all(members)
            ids = [m.id for m in members]
            for m in ids:
                self.nodes[m] = Node("pending", None, [])
            for name, callback in batch.callbacks.items():
                self.nodes[callback.id] = Node("blocked", CALLBACKS[name], list(ids), set(ids))
            self.batches.append((batch.id, [c.id for c in batch.callbacks.values()]))

        @precondition(lambda self: self.batches)
        @rule(pick=st.integers(0, 10_000), size=st.integers(1, 3))
        def join_batch(self, pick: int, size: int) -> None:
            batch_id, callbacks = self.batches[pick % len(self.batches)]
            members = [app.Job(kind="noop", payload={}, max_attempts=1, batch=batch_id) for _ in range(size)]
            if any(self.nodes[c].state != "blocked" for c in callbacks):
                with pytest.raises(InvalidJob, match="has ended"), Session(engine) as session, session.begin():
                    session.add_all(members)
                return
            with Session(engine, expire_on_commit=False) as session, session.begin():
                session.add_all(members)
            for m in members:
                self.nodes[m.id] = Node("pending", None, [])
                for c in callbacks:
                    self.nodes[c].ups.append(m.id)
                    self.nodes[c].waiting.add(m.id)

        @rule()
        def claim(self) -> None:
            with driver.write(engine) as conn:
                claimed = driver.claim(conn, 100, "machine", uuid.uuid4().hex[:12], 60.0, None)
            expected = {i for i, n in self.nodes.items() if n.state == "pending"}
            assert {c.id for c in claimed} == expected, "the claim took other jobs than those due"
            for c in claimed:
                self.nodes[c.id].state = "running"
                self.nodes[c.id].claims += 1
                self.running[c.id] = c

        @precondition(lambda self: self.running)
        @rule(pick=st.integers(0, 10_000))
        def finish(self, pick: int) -> None:
            job = self.running.pop(sorted(self.running)[pick % len(self.running)])
            outcome = Outcome(job, "ok", 0.0)
            self.store.finish_and_claim([outcome], 0, "t", alone=False)
            assert outcome.written
            self.finished(job.id)

        @precondition(lambda self: self.running)
        @rule()
        def finish_all(self) -> None:
            """A worker's batch: every running job finishes in one ``finish_and_claim`` (a batch of members
            whose last ones end together, the case that releases or skips its callbacks)."""
            outcomes = [Outcome(job, "ok", 0.0) for job in self.running.values()]
            self.store.finish_and_claim(outcomes, 0, "t", alone=False)
            assert all(o.written for o in outcomes)
            for job_id in sorted(self.running):
                self.finished(job_id)
            self.running.clear()

        @precondition(lambda self: self.running)
        @rule(pick=st.integers(0, 10_000))
        def fail(self, pick: int) -> None:
            job = self.running.pop(sorted(self.running)[pick % len(self.running)])
            with driver.write(engine) as conn:
                verdict = settle(driver, conn, job.fence, "error", job.attempt, job.max_attempts, error="boom")
            assert verdict is not None and verdict.state == "dead"
            self.nodes[job.id].state = "dead"
            self.failed([job.id], "dead")

        @precondition(lambda self: any(n.state in ("pending", "blocked") for n in self.nodes.values()))
        @rule(pick=st.integers(0, 10_000))
        def cancel(self, pick: int) -> None:
            waiting = sorted(i for i, n in self.nodes.items() if n.state in ("pending", "blocked"))
            job_id = waiting[pick % len(waiting)]
            with Session(engine) as session, session.begin():
                assert app.queue.cancel(session, job_id) == "cancelled"
            self.nodes[job_id].state = "cancelled"
            self.failed([job_id], "cancelled")

        @precondition(lambda self: any(n.state == "dead" for n in self.nodes.values()))
        @rule(pick=st.integers(0, 10_000))
        def requeue(self, pick: int) -> None:
            deads = sorted(i for i, n in self.nodes.items() if n.state == "dead")
            job_id = deads[pick % len(deads)]
            with Session(engine) as session, session.begin():
                app.queue.requeue_dead(session, ids=[job_id])
            self.nodes[job_id].state = "pending"
            self.nodes[job_id].claims = 0  # a new life: it may run once more
            # ... with no upstream left to wait for, so no failure policy: a requeued on_failure callback runs (it
            # is not skipped any more) and may be depended on like any job (hypothesis found the model refusing it).
            self.nodes[job_id].policy = None

        @precondition(lambda self: any(n.state == "dead" for n in self.nodes.values()))
        @rule()
        def purge(self) -> None:
            # "older than 0 s" by the database clock, which counts milliseconds on SQLite: a job dead-lettered in
            # this very millisecond is not older yet. A 2 ms pause makes every dead job older than now.
            time.sleep(0.002)
            deads = sorted(i for i, n in self.nodes.items() if n.state == "dead")
            with Session(engine) as session, session.begin():
                assert app.queue.purge_dead(session, older_than=0) == len(deads)
            for i in deads:
                self.nodes[i].state = "purged"
            self.failed(deads, "purged")

        # -- invariants ---------------------------------------------------------------------------

        @invariant()
        def database_matches_model(self) -> None:
            with engine.connect() as conn:
                rows = {r.id: r for r in conn.execute(select(jobs.c.id, jobs.c.state, jobs.c.waiting_for))}
                dead_ids = set(conn.scalars(select(dead.c.id)))
            for i, node in self.nodes.items():
                if node.state in ("dead", "purged"):
                    assert i not in rows and (i in dead_ids) == (node.state == "dead"), (i, node)
                    continue
                row = rows[i]
                assert row.state == node.state, f"job {i}: database {row.state}, model {node}"
                if node.state == "blocked":
                    assert row.waiting_for == len(node.waiting), f"job {i}: waits for {row.waiting_for}, {node}"
                assert node.claims <= 1, f"job {i} was claimed {node.claims} times in one life"
            assert set(rows) <= set(self.nodes), "a job appeared"

    return GraphMachine


def test_random_graphs_hand_off_as_the_model_says(db: Database) -> None:
    run_state_machine_as_test(
        make_machine(db),
        settings=settings(max_examples=100, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
