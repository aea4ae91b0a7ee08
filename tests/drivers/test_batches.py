"""Batches on every backend: made with their first members, grown later, their callbacks released by the
transaction that ends the last member (through the driver's own acts: the worker's finishes, dead letters,
cancels, requeues and purges), their counts, and bad input refused at flush with nothing written."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from sqla_jobs import Batch, InvalidJob
from sqla_jobs.drivers.base import Claimed
from tests import app
from tests.drivers.conftest import Backend, in_write
from tests.drivers.test_graph import PAST, _dead, add, claim_all, job, requeue, state, waiting

Job = app.Job


def batch_of(**callbacks: Any) -> Batch:
    return Batch(**{name: job("record") for name in callbacks}, label="test")


def status(backend: Backend, batch_id: int) -> Any:
    with backend.db.engine.connect() as conn:
        return app.queue.batch(conn, batch_id)


def ids(batch: Batch) -> dict[str, int]:
    return {name: callback.id for name, callback in batch.callbacks.items()}


def finish_hot(backend: Backend, claimed: list[Claimed]) -> None:
    """Finish as the worker does: the fused finish-and-claim, naming the jobs it knew had dependents
    (PostgreSQL's one-statement path and its hand-off statement; elsewhere ``finish`` first)."""
    fences = [c.fence for c in claimed]
    named = [c.id for c in claimed if c.has_dependents]
    kept, _, _ = in_write(backend, lambda c: backend.driver.finish_and_claim(c, fences, 0, "w", "t", 60.0, None,
                                                                             upstreams=named))
    left = [c for c in claimed if c.id not in kept]  # declined by PostgreSQL's hot statement: Driver.finish
    if left:
        in_write(backend, lambda c: backend.driver.finish(c, [x.fence for x in left]))


def members(n: int, batch: Batch | int, **fields: Any) -> list[Any]:
    return [job(batch=batch, **fields) for _ in range(n)]


def test_a_batch_is_made_with_its_first_members_and_its_callbacks_wait_for_every_one(backend: Backend) -> None:
    batch = batch_of(on_complete=1, on_success=1, on_failure=1)
    assert batch.id is None
    add(backend, *members(3, batch))
    assert batch.id is not None
    for name, callback_id in ids(batch).items():
        row = backend.row(callback_id)
        assert (row.state, row.waiting_for) == ("blocked", 3), name
        assert row.on_upstream_failure == {"on_complete": "run", "on_success": "wait", "on_failure": "errback"}[name]
    now = status(backend, batch.id)
    assert (now.total, now.waiting, now.finished, now.label, now.complete) == (3, 3, 0, "test", False)
    assert {name: s for name, (_, s) in now.callbacks.items()} == dict.fromkeys(ids(batch), "blocked")
    edges = select(func.count()).select_from(backend.driver.edges).scalar_subquery()
    assert backend.scalar(edges) == 9


@pytest.mark.parametrize("how", ["finish", "worker"])
def test_when_every_member_finishes_on_complete_and_on_success_run_and_on_failure_is_skipped(
        backend: Backend, how: str) -> None:
    batch = batch_of(on_complete=1, on_success=1, on_failure=1)
    add(backend, *members(3, batch))
    claimed = backend.claim(100)
    assert len(claimed) == 3
    finisher = finish_hot if how == "worker" else (
        lambda b, c: in_write(b, lambda conn: b.driver.finish(conn, [x.fence for x in c])))
    finisher(backend, claimed[:2])
    assert all(state(backend, i) == "blocked" for i in ids(batch).values())
    finisher(backend, claimed[2:])
    cb = ids(batch)
    assert (state(backend, cb["on_complete"]), state(backend, cb["on_success"])) == ("pending", "pending")
    skipped = backend.row(cb["on_failure"])
    assert skipped.state == "cancelled" and skipped.last_error.startswith("skipped: every member")
    assert skipped.finished_at is not None
    now = status(backend, batch.id)
    assert (now.finished, now.waiting, now.failed, now.complete) == (3, 0, 0, True)
    # Each callback exactly once: the two released are claimable once, the skipped one never.
    assert sorted(c.id for c in backend.claim(100)) == sorted([cb["on_complete"], cb["on_success"]])
    assert backend.claim(100) == []


def test_a_dead_member_runs_on_complete_and_on_failure_and_holds_on_success_until_it_is_requeued(
        backend: Backend) -> None:
    batch = batch_of(on_complete=1, on_success=1, on_failure=1)
    add(backend, *members(2, batch))
    bad, good = backend.claim(100)
    _dead(backend, bad)
    cb = ids(batch)
    # Counted as ended for the two that run anyway; on_success waits for it.
    assert [waiting(backend, cb[n]) for n in ("on_complete", "on_failure", "on_success")] == [1, 1, 2]
    finish_hot(backend, [good])
    assert (state(backend, cb["on_complete"]), state(backend, cb["on_failure"])) == ("pending", "pending")
    assert state(backend, cb["on_success"]) == "blocked"
    now = status(backend, batch.id)
    assert (now.finished, now.dead, now.waiting, now.complete) == (1, 1, 0, True)
    assert requeue(backend, [bad.id]) == [bad.id]
    assert status(backend, batch.id).waiting == 1
    again = [c for c in backend.claim(100) if c.id == bad.id]
    finish_hot(backend, again)
    assert state(backend, cb["on_success"]) == "pending"
    assert (status(backend, batch.id).finished, status(backend, batch.id).dead) == (2, 0)


def test_purging_a_dead_member_cancels_on_success(backend: Backend) -> None:
    batch = batch_of(on_success=1, on_complete=1)
    add(backend, *members(1, batch))
    [bad] = backend.claim(100)
    _dead(backend, bad)
    cb = ids(batch)
    assert (state(backend, cb["on_success"]), state(backend, cb["on_complete"])) == ("blocked", "pending")
    with Session(backend.db.engine) as session, session.begin():
        assert app.queue.purge_dead(session, older_than=0) == 1
    row = backend.row(cb["on_success"])
    assert row.state == "cancelled" and "purged" in row.last_error
    assert status(backend, batch.id).removed == 1


def test_a_cancelled_member_cancels_on_success_and_runs_on_failure_once_the_rest_end(backend: Backend) -> None:
    batch = batch_of(on_complete=1, on_success=1, on_failure=1)
    first, second = members(2, batch)
    add(backend, first, second)
    with Session(backend.db.engine) as session, session.begin():
        assert app.queue.cancel(session, first.id) == "cancelled"
    cb = ids(batch)
    assert state(backend, cb["on_success"]) == "cancelled"
    assert (state(backend, cb["on_complete"]), state(backend, cb["on_failure"])) == ("blocked", "blocked")
    finish_hot(backend, claim_all(backend, [second.id]))
    assert (state(backend, cb["on_complete"]), state(backend, cb["on_failure"])) == ("pending", "pending")
    now = status(backend, batch.id)
    assert (now.finished, now.cancelled, now.failed) == (1, 1, 1)


def test_members_join_an_open_batch_by_object_or_id_in_later_transactions(backend: Backend) -> None:
    batch = batch_of(on_complete=1)
    add(backend, *members(1, batch))
    add(backend, *members(2, batch))  # the same object, flushed before: grows the batch
    add(backend, *members(1, batch.id))
    cb = ids(batch)["on_complete"]
    assert (waiting(backend, cb), status(backend, batch.id).total) == (4, 4)
    with backend.db.engine.connect() as conn:
        assert [u.position for u in backend.driver.upstreams(conn, cb)] == [0, 1, 2, 3]
    claimed = backend.claim(100)
    assert len(claimed) == 4
    finish_hot(backend, claimed)
    assert state(backend, cb) == "pending"


def test_a_member_joining_while_the_last_member_finishes_is_waited_for(backend: Backend) -> None:
    """The joining flush locks the batch row and the callbacks; the worker's finish of the last member
    waits for it, then counts the callback down to 1 (the new member), not 0."""
    batch = batch_of(on_complete=1)
    add(backend, *members(1, batch))
    [last] = backend.claim(100)
    done: list[Any] = []
    session = Session(backend.db.engine, expire_on_commit=False)
    try:
        with session.begin():
            late = job(batch=batch.id)
            session.add(late)
            session.flush()
            finisher = threading.Thread(target=lambda: done.append(finish_hot(backend, [last])))
            finisher.start()
            finisher.join(1.0)
            assert finisher.is_alive(), "the finish did not wait for the joining transaction"
        finisher.join(30)
    finally:
        session.close()
    assert done, "the finish did not return"
    cb = ids(batch)["on_complete"]
    assert (state(backend, cb), waiting(backend, cb)) == ("blocked", 1)
    finish_hot(backend, claim_all(backend, [late.id]))
    assert state(backend, cb) == "pending"


def test_enqueue_many_adds_members_to_a_new_or_an_open_batch(backend: Backend) -> None:
    batch = batch_of(on_complete=1, on_failure=1)
    items = [{"kind": "noop", "payload": {"i": i}, "run_at": PAST} for i in range(50)]
    with Session(backend.db.engine, expire_on_commit=False) as session, session.begin():
        assert app.queue.enqueue_many(session, items, batch=batch) == 50
        held = app.queue.enqueue_unique(session, "noop", {}, unique_key="k", run_at=PAST).job.id
        keyed = [{"kind": "noop", "payload": {}, "unique_key": "k"}, {"kind": "noop", "payload": {}, "unique_key": "j"}]
        assert app.queue.enqueue_many(session, keyed, batch=batch.id) == 1  # "k" is held: skipped, as without
    cb = ids(batch)
    assert status(backend, batch.id).total == waiting(backend, cb["on_complete"]) == 51
    claimed = backend.claim(100)
    assert held in {c.id for c in claimed}
    assert all(backend.row(c.id).has_dependents == (c.id != held) for c in claimed)
    assert all(backend.row(c.id).payload == {"i": c.id - claimed[0].id} for c in claimed[:50])
    finish_hot(backend, claimed)
    assert (state(backend, cb["on_complete"]), state(backend, cb["on_failure"])) == ("pending", "cancelled")


def test_a_batch_rolled_back_leaves_nothing(backend: Backend) -> None:
    batch = batch_of(on_complete=1)
    with pytest.raises(RuntimeError), Session(backend.db.engine) as session, session.begin():
        session.add_all(members(3, batch))
        session.flush()
        raise RuntimeError("the transaction fails")
    for table in (backend.driver.jobs, backend.driver.edges, backend.driver.batches):
        assert backend.scalar(select(func.count()).select_from(table).scalar_subquery()) == 0


def test_a_batch_goes_with_its_last_callback_when_pruned(backend: Backend) -> None:
    batch = batch_of(on_complete=1)
    add(backend, *members(1, batch))
    for _ in range(2):
        finish_hot(backend, backend.claim(10))
    app.queue.prune(backend.db.engine, older_than=0)
    count = select(func.count()).select_from(backend.driver.batches).scalar_subquery()
    # (The partitioned mode prunes whole past days: today's batch stays.)
    assert backend.scalar(count) == (1 if backend.db.partitioned else 0)


def test_a_handler_reads_its_batch_from_a_member_or_a_callback(backend: Backend) -> None:
    batch = batch_of(on_complete=1)
    [member] = members(1, batch)
    add(backend, member, job())
    with backend.db.engine.connect() as conn:
        from_member = backend.driver.batch_of(conn, member.id)
        from_callback = backend.driver.batch_of(conn, ids(batch)["on_complete"])
        assert from_member.id == from_callback.id == batch.id
        assert backend.driver.batch_of(conn, member.id + 1) is None
    with Session(backend.db.engine) as session:
        [listed] = app.queue.batches(session)
        assert (listed.id, listed.total, listed.callbacks["on_complete"][1]) == (batch.id, 1, "blocked")


# -- bad input fails at flush, with nothing written ----------------------------------------------------------


def _refused(backend: Backend, message: str, *jobs: Any) -> None:
    counts = [select(func.count()).select_from(t).scalar_subquery()
              for t in (backend.driver.jobs, backend.driver.edges, backend.driver.batches)]
    before = [backend.scalar(c) for c in counts]
    with pytest.raises(InvalidJob, match=message):
        add(backend, *jobs)
    assert [backend.scalar(c) for c in counts] == before


def test_an_ended_or_unknown_batch_is_refused(backend: Backend) -> None:
    batch = batch_of(on_complete=1)
    add(backend, *members(1, batch))
    finish_hot(backend, backend.claim(10))
    _refused(backend, rf"batch {batch.id} has ended \(job \d+ is pending\)", *members(1, batch))
    _refused(backend, "batch 987654 does not exist", *members(1, 987654))


def test_a_dependent_of_an_on_failure_callback_is_refused(backend: Backend) -> None:
    batch = batch_of(on_failure=1)
    add(backend, *members(1, batch))
    _refused(backend, "depends on a batch's on_failure callback", job(depends_on=[batch.on_failure.id]))
    other = batch_of(on_failure=1)
    _refused(backend, "depends on a batch's on_failure callback", job(depends_on=[other.on_failure]),
             *members(1, other))


def test_bad_batches_are_refused_when_made() -> None:
    with pytest.raises(InvalidJob, match="needs a callback"):
        Batch()
    with pytest.raises(InvalidJob, match="must be a new job"):
        Batch(on_complete={"kind": "x"})
    with pytest.raises(InvalidJob, match="no depends_on, unique_key or on_upstream_failure"):
        Batch(on_complete=job(depends_on=[job()]))
    with pytest.raises(InvalidJob, match="no depends_on, unique_key or on_upstream_failure"):
        Batch(on_complete=job(unique_key="k"))
    same = job()
    with pytest.raises(InvalidJob, match="three different jobs"):
        Batch(on_complete=same, on_success=same)
    with pytest.raises(InvalidJob, match="at most 255"):
        Batch(on_complete=job(), label="x" * 256)
    batch = Batch(on_complete=job())
    with pytest.raises(InvalidJob, match="cannot be one of its members"):
        batch.on_complete.batch = batch
    with pytest.raises(InvalidJob, match="a Batch or a batch's id"):
        job(batch="7")
