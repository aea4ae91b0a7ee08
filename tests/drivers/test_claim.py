"""Claiming: order, limits, queue filters, concurrent claimers, the fused finish-and-claim."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime, timedelta, timezone

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.drivers.conftest import Backend, in_write

PAST = datetime(2020, 1, 1, tzinfo=timezone.utc)


def test_claim_order_is_priority_then_run_at_then_id(backend: Backend) -> None:
    late_low = backend.insert(priority=0, run_at=PAST + timedelta(minutes=5))[0]
    early_low_a, early_low_b = backend.insert(2, priority=0, run_at=PAST)
    high_late = backend.insert(priority=7, run_at=PAST + timedelta(hours=1))[0]
    negative = backend.insert(priority=-3, run_at=PAST - timedelta(days=1))[0]
    expected = [high_late, early_low_a, early_low_b, late_low, negative]
    assert [j.id for j in backend.claim(10)] == expected


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 3)), min_size=1, max_size=8), st.integers(1, 4))
def test_one_at_a_time_follows_the_same_order(backend: Backend, jobs: list[tuple[int, int]], limit: int) -> None:
    with backend.write() as conn:  # each example starts from an empty queue
        conn.execute(backend.driver.jobs.delete())
    ids = [backend.insert(priority=p, run_at=PAST + timedelta(minutes=m))[0] for p, m in jobs]
    order = sorted(zip(ids, jobs, strict=True), key=lambda x: (-x[1][0], x[1][1], x[0]))
    claimed: list[int] = []
    while batch := backend.claim(limit):
        assert len(batch) <= limit
        claimed += [j.id for j in batch]
    assert claimed == [i for i, _ in order]


def test_no_over_claim_and_future_jobs_wait(backend: Backend) -> None:
    due = backend.insert(5, run_at=PAST)
    backend.insert(2, run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    first = backend.claim(3)
    assert len(first) == 3
    second = backend.claim(10)
    assert sorted(j.id for j in first + second) == due
    assert backend.claim(10) == []
    for job in first:
        row = backend.row(job.id)
        assert (row.state, row.attempts, row.locked_by, row.claim_token) == ("running", 1, "conformance", job.token)
        assert job.payload == row.payload and job.attempt == 1 and job.max_attempts == 5


def test_queue_filters(backend: Backend) -> None:
    a = backend.insert(2, queue="a", run_at=PAST)
    b = backend.insert(1, queue="b", run_at=PAST)
    c = backend.insert(1, queue="c", run_at=PAST)
    assert sorted(j.id for j in backend.claim(10, queues=["b"])) == b
    assert [j.id for j in backend.claim(1, queues=["a", "zzz"])] == [a[0]]
    assert sorted(j.id for j in backend.claim(10, queues=["a", "c"])) == sorted([a[1], *c])
    assert backend.claim(10) == []


def test_concurrent_claimers_never_share_a_job(backend: Backend) -> None:
    ids = backend.insert(60, run_at=PAST)
    got: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def claimer(n: int) -> None:
        try:
            while batch := backend.claim(3):
                got[n] += [j.id for j in batch]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    everything = [i for part in got for i in part]
    assert sorted(everything) == ids  # each job exactly once


def test_finish_and_claim_finishes_fenced_jobs_and_claims(backend: Backend) -> None:
    done = backend.claim(2) if backend.insert(2, run_at=PAST) else []
    waiting = backend.insert(3, run_at=PAST)
    stale = (done[0].id, "not-the-token")
    token = uuid.uuid4().hex
    finished, claimed, isolated_waiting = in_write(backend, lambda conn: backend.driver.finish_and_claim(
        conn, [done[1].fence, stale], 2, "conformance", token, 60.0, None))
    assert finished == {done[1].id}
    assert len(claimed) == 2 and {j.id for j in claimed} <= set(waiting) and not isolated_waiting
    assert all(j.token == token for j in claimed)
    assert backend.row(done[0].id).state == "running"
    assert backend.row(done[1].id).state == "finished"
    assert backend.row(done[1].id).finished_at is not None
    # A job given twice, under a stale token and under its own (an abandoned run's outcome and its re-claim's in
    # one batch), is finished once.
    again = in_write(backend, lambda conn: backend.driver.finish_and_claim(
        conn, [stale, done[0].fence, (done[0].id, "also-stale")], 0, "conformance", token, 60.0, None))[0]
    assert again == {done[0].id} and backend.row(done[0].id).state == "finished"


def test_a_discarding_copy_deletes_the_fenced_jobs_it_finishes(backend: Backend) -> None:
    """``Driver.discarding_finished`` (a worker with ``prune_after=0``): the fused finish-and-claim and the
    plain ``finish`` delete what they finish, fenced as ever, and store no result first; the app's own
    driver still keeps them."""
    done = backend.claim(3) if backend.insert(3, run_at=PAST) else []
    waiting = backend.insert(2, run_at=PAST)
    discarding = backend.driver.discarding_finished()
    assert discarding.discard_finished and not backend.driver.discard_finished
    token = uuid.uuid4().hex
    stale = (done[0].id, "not-the-token")
    finished, claimed, _ = in_write(backend, lambda conn: discarding.finish_and_claim(
        conn, [done[1].fence, stale], 5, "conformance", token, 60.0, None))
    assert finished == {done[1].id}
    assert {j.id for j in claimed} == set(waiting)
    assert backend.row(done[1].id) is None  # deleted, not kept finished
    assert backend.row(done[0].id).state == "running"  # a stale fence deletes nothing
    assert in_write(backend, lambda conn: discarding.finish(conn, [done[0].fence, (done[2].id, "stale")])) == {
        done[0].id}
    assert backend.row(done[0].id) is None and backend.row(done[2].id).state == "running"
    # A result for a job about to be deleted is not written (set_results comes just before finish).
    in_write(backend, lambda conn: discarding.set_results(conn, [(done[2].fence, {"kept": False}, None)]))
    assert backend.row(done[2].id).result is None
    assert in_write(backend, lambda conn: backend.driver.finish(conn, [done[2].fence])) == {done[2].id}
    assert backend.row(done[2].id).state == "finished"  # the app's driver keeps them
    assert sorted(j.id for j in claimed) == sorted(
        r.id for r in (backend.row(i) for i in waiting) if r.state == "running")
