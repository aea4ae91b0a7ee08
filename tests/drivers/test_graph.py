"""Job graphs on every backend: a new dependent's flush, the hand-off when an upstream ends, failure policies.

Dependents are added through the ORM (``Job(depends_on=...)``), as users add them; upstreams end through
the driver's own acts (``finish``, ``finish_and_claim``, ``dead_letter``, ``release``, ``cancel``, requeue,
purge), the ones the worker and the admin commands call.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session

from sqla_jobs import InvalidJob
from sqla_jobs._graph import DEPENDENTS_PAGE
from sqla_jobs.drivers.base import Claimed
from tests import app
from tests.drivers.conftest import Backend, in_write

Job = app.Job
PAST = datetime(2020, 1, 1, tzinfo=timezone.utc)


def add(backend: Backend, *jobs: Any) -> list[int]:
    """Commit ``jobs`` (and the new upstreams they name) in one ORM transaction; their ids."""
    with Session(backend.db.engine, expire_on_commit=False) as session, session.begin():
        session.add_all(jobs)
    return [job.id for job in jobs]


def requeue(backend: Backend, ids: list[int]) -> list[int]:
    with Session(backend.db.engine) as session, session.begin():
        return app.queue.requeue_dead(session, ids=ids)


def job(kind: str = "noop", **fields: Any) -> Any:
    return Job(kind=kind, payload={}, run_at=PAST, **fields)


def state(backend: Backend, job_id: int) -> str | None:
    row = backend.row(job_id)
    return None if row is None else str(row.state)


def waiting(backend: Backend, job_id: int) -> int:
    return int(backend.row(job_id).waiting_for)


def claim_all(backend: Backend, ids: list[int]) -> list[Claimed]:
    claimed = backend.claim(100)
    assert sorted(c.id for c in claimed) == sorted(ids), (claimed, ids)
    return claimed


def finish(backend: Backend, jobs: list[Claimed]) -> set[int]:
    return in_write(backend, lambda c: backend.driver.finish(c, [j.fence for j in jobs]))  # type: ignore[no-any-return]


# -- adding dependents -----------------------------------------------------------------------------


def test_a_dependent_of_new_jobs_is_blocked_and_counts_them(backend: Backend) -> None:
    pages = [job() for _ in range(3)]
    merge = job("noop", depends_on=pages)
    [merge_id] = add(backend, merge)  # the pages come with it
    assert state(backend, merge_id) == "blocked"
    assert waiting(backend, merge_id) == 3
    page_ids = [p.id for p in pages]
    assert all(state(backend, i) == "pending" and backend.row(i).has_dependents for i in page_ids)
    with backend.db.engine.connect() as conn:
        ups = backend.driver.upstreams(conn, merge_id)
        assert [(u.position, u.id) for u in ups] == list(enumerate(page_ids))
        assert [d.id for d in backend.driver.neighbours(conn, page_ids[0], upstream=False)] == [merge_id]
    # The claim never sees a blocked job.
    assert sorted(c.id for c in backend.claim(100)) == sorted(page_ids)


def test_a_dependent_of_existing_jobs_by_id_counts_only_those_not_finished(backend: Backend) -> None:
    done, running, pending = add(backend, job(), job(), job())
    first = claim_all(backend, [done, running, pending])
    finish(backend, [c for c in first if c.id == done])
    in_write(backend, lambda c: backend.driver.release(c, next(j.fence for j in first if j.id == pending)))
    # the same upstream twice (as an id, then again) is one dependency
    [dependent] = add(backend, job("noop", depends_on=[done, running, pending, running]))
    assert state(backend, dependent) == "blocked"
    assert waiting(backend, dependent) == 2
    assert backend.row(running).has_dependents and backend.row(pending).has_dependents
    with backend.db.engine.connect() as conn:
        assert [u.id for u in backend.driver.upstreams(conn, dependent)] == [done, running, pending]
    # On finished upstreams only: not blocked at all.
    [free] = add(backend, job("noop", depends_on=[done]))
    assert state(backend, free) == "pending"


def test_the_last_upstream_to_finish_unblocks_in_its_own_transaction(backend: Backend) -> None:
    ups = [job() for _ in range(3)]
    [join] = add(backend, job("noop", depends_on=ups))
    claimed = claim_all(backend, [u.id for u in ups])
    finish(backend, claimed[:1])
    assert (state(backend, join), waiting(backend, join)) == ("blocked", 2)
    finish(backend, claimed[1:])  # two in one finish: counted down by two
    assert (state(backend, join), waiting(backend, join)) == ("pending", 0)
    assert [c.id for c in backend.claim(10)] == [join]


def test_an_upstreams_finish_writes_each_dependent_it_counts_down_once(backend: Backend) -> None:
    """The count-down and the release are one UPDATE where every SET reads the row as it was (PostgreSQL,
    SQLite): a fan-out's root writes each of its dependents once, not twice (SQLite's fan-out drained at 0.65
    of its plain drain with two). MariaDB/MySQL give a joined UPDATE's SETs no order: two statements there."""
    root = job()
    fan = [job(depends_on=[root]) for _ in range(30)]
    join = job(depends_on=[root, fan[0]])  # still waits for fan[0]: counted down, not released
    add(backend, *fan, join)
    [claimed] = claim_all(backend, [root.id])
    updates: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if re.match(r"\s*UPDATE jobs\b", statement):  # MariaDB's joined UPDATE: "UPDATE jobs, (SELECT ...)"
            updates.append(statement)

    with backend.write() as conn:
        event.listen(conn, "before_cursor_execute", count)
        assert backend.driver.finish(conn, [claimed.fence]) == {root.id}
        event.remove(conn, "before_cursor_execute", count)
    # The finish itself, then the count-down: with the release in it, or after it.
    assert len(updates) == (3 if backend.name in ("mysql", "mariadb") else 2), updates
    assert {state(backend, f.id) for f in fan} == {"pending"}
    assert (state(backend, join.id), waiting(backend, join.id)) == ("blocked", 1)


def test_an_unblocking_finish_rolled_back_leaves_the_dependent_blocked(backend: Backend) -> None:
    up = job()
    [down] = add(backend, job("noop", depends_on=[up]))
    [claimed] = claim_all(backend, [up.id])
    with pytest.raises(RuntimeError), backend.write() as conn:
        assert backend.driver.finish(conn, [claimed.fence]) == {up.id}
        raise RuntimeError("the finishing transaction fails after the finish")
    assert (state(backend, up.id), state(backend, down)) == ("running", "blocked")
    finish(backend, [claimed])
    assert state(backend, down) == "pending"


def test_the_hot_finish_and_claim_finishes_or_leaves_a_job_with_dependents_never_half(backend: Backend) -> None:
    """PostgreSQL's one-statement finish leaves such a job to ``Driver.finish`` (Store.finish_declined); the
    others finish it and count down in the same transaction. Either way no dependent is left behind."""
    up, plain = job(), job()
    [down] = add(backend, job("noop", depends_on=[up]), plain)[:1]
    claimed = claim_all(backend, [up.id, plain.id])
    fences = [c.fence for c in claimed]
    kept, _, _ = in_write(backend, lambda c: backend.driver.finish_and_claim(c, fences, 0, "w", "t", 60.0, None))
    assert plain.id in kept
    if up.id in kept:
        assert state(backend, down) == "pending"
    else:
        assert backend.name == "postgresql"
        assert (state(backend, up.id), state(backend, down)) == ("running", "blocked")
        assert finish(backend, [c for c in claimed if c.id == up.id]) == {up.id}
        assert state(backend, down) == "pending"


def test_a_chain_runs_one_link_at_a_time(backend: Backend) -> None:
    links = [job("noop")]
    for _ in range(4):
        links.append(job("noop", depends_on=[links[-1]]))
    add(backend, *links)
    for link in links:
        [claimed] = backend.claim(10)
        assert claimed.id == link.id
        finish(backend, [claimed])
    assert backend.claim(10) == []


# -- upstream failures ---------------------------------------------------------------------------------


def _dead(backend: Backend, claimed: Claimed) -> None:
    assert in_write(backend, lambda c: backend.driver.dead_letter(c, claimed.fence, "boom"))


@pytest.mark.parametrize("policy", [None, "cancel", "run", "wait"])
def test_a_dead_upstream_and_each_policy(backend: Backend, policy: str | None) -> None:
    bad, good = job(), job()
    dependent = job("noop", depends_on=[bad, good], on_upstream_failure=policy)
    grandchild = job("noop", depends_on=[dependent])
    add(backend, dependent, grandchild)
    claimed = {c.id: c for c in claim_all(backend, [bad.id, good.id])}
    _dead(backend, claimed[bad.id])
    if policy == "run":
        assert (state(backend, dependent.id), waiting(backend, dependent.id)) == ("blocked", 1)
        finish(backend, [claimed[good.id]])
        assert state(backend, dependent.id) == "pending"
        with backend.db.engine.connect() as conn:
            assert [u.ended for u in backend.driver.upstreams(conn, dependent.id)] == ["dead", None]
    elif policy == "wait":
        finish(backend, [claimed[good.id]])
        assert (state(backend, dependent.id), waiting(backend, dependent.id)) == ("blocked", 1)
        assert requeue(backend, [bad.id]) == [bad.id]
        assert backend.row(bad.id).has_dependents
        [again] = backend.claim(10)
        assert again.id == bad.id
        finish(backend, [again])
        assert state(backend, dependent.id) == "pending"
    else:
        row = backend.row(dependent.id)
        assert row.state == "cancelled"
        assert f"upstream job {bad.id} was dead-lettered" in row.last_error
        after = backend.row(grandchild.id)
        assert after.state == "cancelled"
        assert f"upstream job {dependent.id} was cancelled" in after.last_error
        finish(backend, [claimed[good.id]])  # a later finish leaves the cancelled dependent alone
        assert state(backend, dependent.id) == "cancelled"


def test_a_run_anyway_dependent_is_counted_once_when_its_dead_upstream_is_requeued_and_finishes(
        backend: Backend) -> None:
    bad, slow = job(), job()
    dependent = job("noop", depends_on=[bad, slow], on_upstream_failure="run")
    add(backend, dependent)
    claimed = {c.id: c for c in claim_all(backend, [bad.id, slow.id])}
    _dead(backend, claimed[bad.id])
    assert waiting(backend, dependent.id) == 1
    requeue(backend, [bad.id])
    [again] = backend.claim(10)
    finish(backend, [again])
    # Still waiting for `slow`: the requeued upstream was counted when it died, not again now.
    assert (state(backend, dependent.id), waiting(backend, dependent.id)) == ("blocked", 1)
    finish(backend, [claimed[slow.id]])
    assert state(backend, dependent.id) == "pending"


def test_a_cancelled_run_cancels_its_dependents(backend: Backend) -> None:
    up = job()
    [down] = add(backend, job("noop", depends_on=[up], on_upstream_failure="wait"))
    [claimed] = claim_all(backend, [up.id])
    assert in_write(backend, lambda c: backend.driver.release(c, claimed.fence, cancel=True))
    row = backend.row(down)
    assert row.state == "cancelled" and f"upstream job {up.id} was cancelled" in row.last_error


def test_cancelling_a_blocked_job_cancels_its_dependents_down_the_graph(backend: Backend) -> None:
    up = job()
    middle = job("noop", depends_on=[up])
    last = job("noop", depends_on=[middle])
    add(backend, last)
    with Session(backend.db.engine) as session, session.begin():
        assert app.queue.cancel(session, middle.id) == "cancelled"
    assert (state(backend, up.id), state(backend, middle.id), state(backend, last.id)) == (
        "pending", "cancelled", "cancelled")


def test_purging_a_dead_upstream_cancels_the_dependents_waiting_for_it(backend: Backend) -> None:
    up = job()
    [down] = add(backend, job("noop", depends_on=[up], on_upstream_failure="wait"))
    [claimed] = claim_all(backend, [up.id])
    _dead(backend, claimed)
    assert state(backend, down) == "blocked"
    with Session(backend.db.engine) as session, session.begin():
        assert app.queue.purge_dead(session, older_than=0) == 1
    row = backend.row(down)
    assert row.state == "cancelled" and "purged" in row.last_error


# -- bad graphs fail at flush, with nothing written -------------------------------------------------


def _rejected(backend: Backend, message: str, *jobs: Any) -> None:
    t = backend.driver.jobs
    before = backend.scalar(select(func.count()).select_from(t).scalar_subquery())
    with pytest.raises(InvalidJob, match=message):
        add(backend, *jobs)
    assert backend.scalar(select(func.count()).select_from(t).scalar_subquery()) == before
    assert backend.scalar(select(func.count()).select_from(backend.driver.edges).scalar_subquery()) == 0


def test_a_cycle_is_refused(backend: Backend) -> None:
    a, b = job("noop"), job("record")
    a.depends_on = [b]
    b.depends_on = [a]
    _rejected(backend, "cycle: 'noop' -> 'record' -> 'noop'|cycle: 'record' -> 'noop' -> 'record'", a, b)


def test_an_unknown_or_dead_upstream_is_refused(backend: Backend) -> None:
    _rejected(backend, "depends on job 987654, which is not in table 'jobs'", job(depends_on=[987654]))
    [up] = add(backend, job())
    [claimed] = claim_all(backend, [up])
    _dead(backend, claimed)
    _rejected(backend, f"depends on job {up}, which is in the dead letters: requeue it first",
              job(depends_on=[up]))


def test_a_cancelled_upstream_is_refused_unless_the_dependent_runs_anyway(backend: Backend) -> None:
    [up] = add(backend, job())
    with Session(backend.db.engine) as session, session.begin():
        app.queue.cancel(session, up)
    _rejected(backend, f"depends on job {up}, which was cancelled", job(depends_on=[up]))
    [anyway] = add(backend, job(depends_on=[up], on_upstream_failure="run"))
    assert state(backend, anyway) == "pending"


def test_other_bad_values_are_refused_when_set(backend: Backend) -> None:
    with pytest.raises(InvalidJob, match="on_upstream_failure must be one of"):
        job(on_upstream_failure="retry")
    with pytest.raises(InvalidJob, match="list of jobs or job ids"):
        job(depends_on=42)
    with pytest.raises(InvalidJob, match="holds jobs"):
        job(depends_on=["42"])
    with pytest.raises(InvalidJob, match="holds jobs"):
        job(depends_on=[True])
    [done] = add(backend, job())
    with Session(backend.db.engine) as session:
        existing = session.get(Job, done)
        with pytest.raises(InvalidJob, match="before the job is first flushed"):
            existing.depends_on = []
    _rejected(backend, "cannot have a unique_key", job(depends_on=[job()], unique_key="k"))


# -- the race: a dependent added while its upstream's run is being finished --------------------------


@pytest.mark.parametrize("known", [False, True], ids=["no-dependent-at-claim", "a-dependent-at-claim"])
def test_a_dependent_added_while_the_worker_finishes_its_upstream_is_never_left_blocked(
        backend: Backend, known: bool) -> None:
    """The worker's own write (``Store.finish_and_claim``) waits for the adding transaction's lock on the
    upstream. Then, on PostgreSQL: an upstream the worker knew had dependents (``Claimed.has_dependents``) is
    finished by the hot statement and counted down by the next statement of its transaction (handoff.py),
    whose snapshot has the new dependent; one that gained its first dependent after the claim is left by the
    hot statement (its ``NOT has_dependents``) to ``Driver.finish`` (``Store.finish_declined``). Elsewhere the
    finish counts down in its transaction. Without the hot statement's test, or without the hand-off
    statement, the upstream finished and the new dependent stayed blocked for ever (both checked)."""
    import threading

    from sqla_jobs.worker.runs import Outcome
    from sqla_jobs.worker.store import Store

    up = job()
    first = add(backend, job(depends_on=[up]))[0] if known else add(backend, up) and None
    [claimed] = claim_all(backend, [up.id])
    assert claimed.has_dependents == (known and backend.name == "postgresql")  # only PostgreSQL's claim reads it
    store = Store(backend.db.engine, app.queue, backend.driver, "conformance", 60.0, None)
    done: list[Any] = []
    session = Session(backend.db.engine, expire_on_commit=False)
    try:
        with session.begin():
            dependent = job(depends_on=[up.id])
            session.add(dependent)
            session.flush()  # the upstream is locked (marked has_dependents) until this commits
            finisher = threading.Thread(target=lambda: done.append(
                store.finish_and_claim([Outcome(claimed, "ok", 0.0)], 0, "t2", alone=False)))
            finisher.start()
            finisher.join(1.0)
            assert finisher.is_alive(), "the worker's finish did not wait for the adding transaction"
        finisher.join(30)
    finally:
        session.close()
        store.close()
    assert done, "the worker's finish did not return"
    assert (state(backend, up.id), state(backend, dependent.id)) == ("finished", "pending")
    if first is not None:
        assert state(backend, first) == "pending"


def test_a_finish_sent_again_after_its_reply_was_lost_counts_nothing_down_twice(backend: Backend) -> None:
    """A worker whose connection dropped after its commit sends the same batch again: that finishes nothing,
    so it counts nothing down (PostgreSQL's hand-off counts only upstreams its own transaction finished)."""
    a, b = job(), job()
    [down] = add(backend, job(depends_on=[a, b]))
    claimed = {c.id: c for c in claim_all(backend, [a.id, b.id])}
    fences, named = [claimed[a.id].fence], [a.id] if claimed[a.id].has_dependents else []
    for _ in range(2):
        in_write(backend, lambda c: backend.driver.finish_and_claim(c, fences, 0, "w", "t", 60.0, None,
                                                                    upstreams=named))
    if backend.name == "postgresql":
        assert named, "PostgreSQL's claim did not say the job has dependents"
        assert state(backend, a.id) == "finished"
    assert (state(backend, down), waiting(backend, down)) == ("blocked", 1)


def test_an_upstream_named_but_not_finished_counts_nothing_down(backend: Backend) -> None:
    """A worker names an upstream whose claim is no longer its own (another token on the row): the finish
    leaves it running, and its dependent stays blocked; only what the finish took is handed off."""
    up = job()
    [down] = add(backend, job(depends_on=[up]))
    [claimed] = claim_all(backend, [up.id])
    named = [up.id] if claimed.has_dependents else []
    assert bool(named) == (backend.name == "postgresql"), "only PostgreSQL's claim says a job has dependents"
    in_write(backend, lambda c: backend.driver.finish_and_claim(c, [(up.id, "not-its-token")], 0, "w", "t", 60.0,
                                                                None, upstreams=named))
    assert (state(backend, up.id), state(backend, down), waiting(backend, down)) == ("running", "blocked", 1)
    in_write(backend, lambda c: backend.driver.finish_and_claim(c, [claimed.fence], 0, "w", "t", 60.0, None,
                                                                upstreams=named))
    assert (state(backend, up.id), state(backend, down), waiting(backend, down)) == ("finished", "pending", 0)


def test_an_unblocked_job_is_due_from_the_moment_it_was_unblocked(backend: Backend) -> None:
    """Its age as a pending job (the queue's "oldest pending" alarm) starts when it became pending, not when
    it was added: a join that waited an hour for its pages is not an hour-old job in the queue."""
    up = job()
    [down] = add(backend, job(depends_on=[up]))
    assert backend.row(down).run_at.replace(tzinfo=None) == PAST.replace(tzinfo=None)
    [claimed] = claim_all(backend, [up.id])
    finish(backend, [claimed])
    row, upstream = backend.row(down), backend.row(up.id)
    assert row.state == "pending" and row.run_at >= upstream.finished_at


def test_pruning_a_dependent_takes_its_edges_with_it(backend: Backend) -> None:
    """(The partitioned mode prunes whole past days by DROP TABLE, so today's jobs stay, edges and all; the
    edges of a dropped day stay too: docs/howto/graphs.md.)"""
    up = job()
    add(backend, job(depends_on=[up]))
    for _ in range(2):
        finish(backend, backend.claim(10))
    edges = backend.driver.edges
    count = select(func.count()).select_from(edges).scalar_subquery()
    assert backend.scalar(count) == 1
    pruned = app.queue.prune(backend.db.engine, older_than=0)
    assert (pruned, backend.scalar(count)) == ((0, 1) if backend.db.partitioned else (2, 0))


# -- showing a graph (the CLI's `jobs show`, the dashboard's job page, stats) ------------------------------------


def test_a_neighbourhood_is_read_with_each_neighbours_state_and_blocked_jobs_are_counted_per_queue(
        backend: Backend) -> None:
    bad, good = job(), job()
    dependent = job("noop", depends_on=[bad, good], on_upstream_failure="run", queue="graphs")
    after = job("noop", depends_on=[dependent])
    add(backend, dependent, after)
    claimed = {c.id: c for c in claim_all(backend, [bad.id, good.id])}
    _dead(backend, claimed[bad.id])
    with backend.db.engine.connect() as conn:
        def side(job_id: int, upstream: bool, limit: int | None = None) -> list[tuple[Any, ...]]:
            rows = backend.driver.neighbours(conn, job_id, upstream=upstream, limit=limit)
            return [(r.id, r.kind, r.state, r.ended) for r in rows]

        # The dead upstream is read from the dead letters; the edge says its failure was counted as done.
        assert side(dependent.id, True) == [(bad.id, "noop", "dead", "dead"), (good.id, "noop", "running", None)]
        assert side(dependent.id, True, limit=1) == [(bad.id, "noop", "dead", "dead")]
        assert side(bad.id, False) == [(dependent.id, "noop", "blocked", "dead")]  # a dead job's dependents
        assert side(dependent.id, False) == [(after.id, "noop", "blocked", None)]
        assert side(after.id, False) == []
        counts = {j.id: backend.driver.edge_counts(conn, j.id) for j in (bad, dependent, after)}
        assert counts == {bad.id: (0, 1), dependent.id: (2, 1), after.id: (1, 0)}
        assert [tuple(r) for r in backend.driver.blocked_by_queue(conn)] == [("default", 1), ("graphs", 1)]


def test_a_long_chain_of_new_jobs_is_one_flush(backend: Backend) -> None:
    """The flush's cycle check walks without recursion: 3,000 new links (three times Python's recursion limit)
    in one ``add_all``; each waits for one upstream, and only the first is due."""
    links = [job()]
    for _ in range(2999):
        links.append(job(depends_on=[links[-1]]))
    add(backend, *links)
    t = backend.driver.jobs
    with backend.db.engine.connect() as conn:
        counts = dict(conn.execute(select(t.c.state, func.count()).group_by(t.c.state)).all())
    assert counts == {"pending": 1, "blocked": 2999}
    assert backend.scalar(select(func.max(t.c.waiting_for)).scalar_subquery()) == 1


def test_new_dependents_are_inserted_in_short_pages_and_the_connection_keeps_its_own_setting(
        backend: Backend) -> None:
    """A flush that writes new dependents inserts them ``DEPENDENTS_PAGE`` rows a statement (with their three
    extra values, 1,000-row statements made a chain's enqueue 1.47 times a plain one's), and the connection
    the session was given gets its own page size back; a later flush of plain jobs uses it."""
    statements: list[str] = []  # the jobs table's INSERTs (the edges' table is jobs_deps)

    def count(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.startswith("INSERT INTO jobs "):
            statements.append(statement)

    with backend.db.engine.connect() as conn:
        conn.execution_options(insertmanyvalues_page_size=500)
        event.listen(conn, "before_cursor_execute", count)
        links = [job()]
        for _ in range(2 * DEPENDENTS_PAGE + 49):
            links.append(job(depends_on=[links[-1]]))
        with Session(conn, join_transaction_mode="create_savepoint") as session:
            session.add_all(links)
            session.flush()
            chained = len(statements)
            assert conn.get_execution_options()["insertmanyvalues_page_size"] == 500
            statements.clear()
            session.add_all([job() for _ in range(2 * DEPENDENTS_PAGE + 50)])
            session.flush()
        conn.rollback()
    if backend.name == "sqlite":  # its flush inserts a row a statement, pages or not
        assert chained == len(statements) == len(links)
    else:
        assert len(statements) == 1  # the plain jobs: the connection's own 500 rows a statement again
        # The first link has no upstream and the last no dependent (each its own columns, so its own
        # statement); the 248 between take three pages.
        assert chained == 5


def test_an_upstream_of_another_jobs_table_is_refused(backend: Backend) -> None:
    """A dependency stays within one jobs table: its count and edges are that table's."""
    from sqlalchemy.orm import DeclarativeBase

    from sqla_jobs import JobMixin

    class Other(DeclarativeBase):
        pass

    class OtherJob(JobMixin, Other):
        __tablename__ = "other_jobs"

    _rejected(backend, "depends on a job of table 'other_jobs', not 'jobs'",
              job(depends_on=[OtherJob(kind="noop", payload={})]))


def test_a_unique_job_is_an_upstream_like_any_other(backend: Backend) -> None:
    """Unique jobs (and periodic slots, which are unique jobs) as members of a graph: the key stays on the upstream."""
    with Session(backend.db.engine) as session, session.begin():
        held = app.queue.enqueue_unique(session, "noop", {}, unique_key="report:today", run_at=PAST)
    [down] = add(backend, job(depends_on=[held.id]))
    assert (state(backend, down), waiting(backend, down)) == ("blocked", 1)
    finish(backend, claim_all(backend, [held.id]))
    assert state(backend, down) == "pending"
