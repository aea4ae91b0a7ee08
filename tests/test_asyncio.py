"""Enqueue and admin through SQLAlchemy's ``AsyncSession`` (``queue.aio``, docs/howto/asyncio.md).

Each test drives the async drivers on every backend (aiosqlite, psycopg's async
connection, aiomysql) and checks the outcome with a real worker or a sync read of
the same database: what an async transaction commits runs, what it rolls back never
exists, and every async form answers exactly like its sync twin.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import warnings
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Row, delete, event, func, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sqla_jobs import ConfigError, JobStateError, NotFound
from sqla_jobs.testing import run_due
from tests import app
from tests.conftest import Database

T = TypeVar("T")
queue = app.queue

#: The async DBAPI driver the tests use per backend (the sync suite's URL, driver swapped).
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg", "mariadb": "mariadb+aiomysql"}


def async_url(db: Database) -> URL:
    return make_url(db.url).set(drivername=ASYNC_DRIVERS[db.backend])


def run(db: Database, scenario: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """Run ``scenario`` with an async engine on ``db``'s database, in a fresh event loop."""

    async def main() -> T:
        engine = create_async_engine(async_url(db))
        try:
            return await scenario(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def payloads(db: Database) -> list[dict[str, Any]]:
    with Session(db.engine) as session:
        return [job.payload for job in session.scalars(select(app.Job).order_by(app.Job.id))]


# -- committed runs, rolled back never exists ---------------------------------------------------------


def test_an_async_transaction_that_commits_runs_its_jobs_and_one_that_rolls_back_leaves_none(db: Database) -> None:
    async def scenario(engine: AsyncEngine) -> tuple[list[int], list[int]]:
        ids: dict[str, list[int]] = {}
        for outcome in ("commit", "rollback"):
            async with AsyncSession(engine) as session:
                await session.begin()
                job = app.Job(kind="noop", payload={"via": "add", "outcome": outcome})
                session.add(job)
                unique = await queue.aio.enqueue_unique(session, "noop", {"via": "unique", "outcome": outcome},
                                                        unique_key=f"key-{outcome}")
                made = await queue.aio.enqueue(session, "noop", {"via": "enqueue", "outcome": outcome})
                count = await queue.aio.enqueue_many(
                    session, [{"kind": "noop", "payload": {"via": "many", "n": n, "outcome": outcome}} for n in (1, 2)]
                )
                assert count == 2
                await session.flush()
                ids[outcome] = [job.id, unique.id, made.id]
                await (session.commit() if outcome == "commit" else session.rollback())
        return ids["commit"], ids["rollback"]

    kept, dropped = run(db, scenario)
    assert {p["outcome"] for p in payloads(db)} == {"commit"}  # nothing of the rolled-back transaction exists
    report = run_due(db.engine, queue)  # a real worker on a sync engine to the same database
    assert len(report.finished) == 5 and set(kept) <= {e.id for e in report.finished}
    with Session(db.engine) as session:
        assert session.scalars(select(app.Job.state)).all() == ["finished"] * 5
        assert all(session.get(app.Job, job_id) is None for job_id in dropped if job_id not in kept)


# -- every async form answers like its sync twin ----------------------------------------------------------


def test_async_reads_and_changes_match_the_sync_calls(db: Database) -> None:
    later = datetime.now(timezone.utc) + timedelta(hours=1)

    async def enqueue(engine: AsyncEngine) -> dict[str, int]:
        async with AsyncSession(engine) as session, session.begin():
            first = await queue.aio.enqueue_unique(session, "noop", {"n": 1}, unique_key="only-one")
            again = await queue.aio.enqueue(session, "noop", {"n": 2}, unique_key="only-one")
            assert (first.inserted, again.id) == (True, first.id)
            delayed = await queue.aio.enqueue(session, "noop", {"n": 3}, run_at=later)
            pending = await queue.aio.enqueue(session, "noop", {"n": 4}, run_at=later)
            await queue.aio.enqueue_many(session, [{"kind": "fail", "max_attempts": 1, "payload": {"n": n}}
                                                   for n in (5, 6)])
            await session.flush()
            return {"unique": first.id, "delayed": delayed.id, "pending": pending.id}

    ids = run(db, enqueue)
    dead = [e.id for e in run_due(db.engine, queue).dead]  # the two "fail" jobs; the rest wait or run
    assert len(dead) == 2

    async def admin(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session, session.begin():
            row = await queue.aio.get_job(session, ids["delayed"])
            assert (row.id, row.state, row.payload) == (ids["delayed"], "pending", {"n": 3})
            assert await queue.aio.get_job(session, 10**9) is None
            listed = await queue.aio.list_jobs(session, kind="noop", state="pending")
            assert [r.id for r in listed] == [ids["pending"], ids["delayed"]]
            assert [r.id for r in await queue.aio.list_jobs(session, unique_key="only-one")] == [ids["unique"]]
            assert await queue.aio.cancel(session, ids["pending"]) == "cancelled"
            with pytest.raises(JobStateError, match="cancelled already"):
                await queue.aio.cancel(session, ids["pending"])
            with pytest.raises(NotFound, match="dead-letter table"):
                await queue.aio.cancel(session, dead[0])
            await queue.aio.retry_now(session, ids["delayed"])
            assert sorted(r.id for r in await queue.aio.list_dead(session, kind="fail")) == sorted(dead)
            assert (await queue.aio.get_dead(session, dead[0])).kind == "fail"
            assert await queue.aio.requeue_dead(session, ids=[dead[0]]) == [dead[0]]
            with pytest.raises(NotFound, match="no dead job with id 1000000000"):
                await queue.aio.requeue_dead(session, ids=[10**9])
            assert await queue.aio.purge_dead(session, older_than=0) == 1
        async with AsyncSession(engine) as session:
            for bind in (engine, session):
                stats = await queue.aio.stats(bind, run_times=False)
                assert (stats.ready, stats.scheduled) == (2, 0)  # the delayed job made due, the requeued one
        async with engine.connect() as conn:
            assert (await queue.aio.stats(conn)).dead == []
        await queue.aio.check_schema(engine)
        await queue.aio.create_tables(engine)  # present already: nothing to do, nothing fails

    run(db, admin)
    with Session(db.engine) as session:
        sync_stats = queue.stats(session, run_times=False)
        assert (sync_stats.ready, sync_stats.scheduled, sync_stats.dead) == (2, 0, [])
        assert session.get(app.Job, ids["pending"]).state == "cancelled"  # type: ignore[union-attr]
        assert queue.get_dead(session, dead[0]) is None and queue.get_job(session, dead[0]) is not None


def test_postgres_enqueue_many_through_an_async_session_loads_with_copy(pg: Database) -> None:
    """COPY through psycopg's async connection: SQLAlchemy sees no INSERT, yet every row is there."""
    queue.create_tables(pg.engine)
    statements: list[str] = []

    async def scenario(engine: AsyncEngine) -> int:
        event.listen(engine.sync_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
        async with AsyncSession(engine) as session, session.begin():
            inserted = await queue.aio.enqueue_many(
                session, [{"kind": "noop", "payload": {"n": n}, **({"run_at": None} if n % 2 else {})}
                          for n in range(500)]
            )
            assert inserted == 500
            return int((await session.execute(select(func.count()).select_from(app.Job))).scalar_one())

    assert run(pg, scenario) == 500  # counted in the same transaction, by a statement the listener saw
    assert statements and not [s for s in statements if "INSERT" in s.upper()]
    assert sorted(p["n"] for p in payloads(pg)) == list(range(500))


# -- the wrong flavour gets a clear error, never an un-awaited coroutine ---------------------------------

SYNC_CALLS: dict[str, Callable[[Any], Any]] = {
    "enqueue": lambda s: queue.enqueue(s, "noop", unique_key="k"),
    "enqueue_unique": lambda s: queue.enqueue_unique(s, "noop", unique_key="k"),
    "enqueue_many": lambda s: queue.enqueue_many(s, [{"kind": "noop"}]),
    "get_job": lambda s: queue.get_job(s, 1),
    "get_dead": lambda s: queue.get_dead(s, 1),
    "list_jobs": lambda s: queue.list_jobs(s),
    "list_dead": lambda s: queue.list_dead(s),
    "cancel": lambda s: queue.cancel(s, 1),
    "retry_now": lambda s: queue.retry_now(s, 1),
    "requeue_dead": lambda s: queue.requeue_dead(s, everything=True),
    "purge_dead": lambda s: queue.purge_dead(s, older_than=0),
    "stats": lambda s: queue.stats(s),
}


def test_sync_calls_given_async_objects_say_what_to_await_instead(db: Database) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session:
            for name, call in SYNC_CALLS.items():
                with pytest.raises(ConfigError, match=rf"await queue\.aio\.{name}\(") as raised:
                    call(session)
                assert "AsyncSession" in str(raised.value)
            assert not session.in_transaction()  # refused before touching the database
        for name, call in {"stats": queue.stats, "check_schema": queue.check_schema,
                           "create_tables": queue.create_tables}.items():
            with pytest.raises(ConfigError, match=rf"await queue\.aio\.{name}\("):
                call(engine)
        for call in (lambda e: queue.prune(e, older_than=0), queue.enqueue_periodic):
            with pytest.raises(ConfigError, match="has no asyncio form: give it a sync Engine"):
                call(engine)
        with Session(db.engine) as sync_session:
            with pytest.raises(ConfigError, match=r"queue\.aio\.cancel takes an AsyncSession, got Session"):
                await queue.aio.cancel(sync_session, 1)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match=r"queue\.aio\.check_schema takes an AsyncEngine, got Engine"):
                await queue.aio.check_schema(db.engine)  # type: ignore[arg-type]
        async with engine.connect() as conn:
            with pytest.raises(ConfigError, match=r"takes an AsyncSession, got AsyncConnection: open one with"):
                await queue.aio.get_job(conn, 1)  # type: ignore[arg-type]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(db, scenario)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    # A plain enqueue is session.add: no I/O, so it works on an AsyncSession as well.

    async def plain(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session, session.begin():
            queue.enqueue(session, "noop", {"plain": True})

    run(db, plain)
    assert payloads(db) == [{"plain": True}]


# -- property: the async path stores exactly what the sync path stores ------------------------------------

# Valid payload text: no NUL (PostgreSQL jsonb rejects it) and no lone surrogates (not encodable).
safe_text = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=8)
job_items = st.fixed_dictionaries(
    {"kind": st.sampled_from(["noop", "record", "fail"])},
    optional={
        "payload": st.dictionaries(safe_text, st.integers(-(2**31), 2**31) | safe_text | st.none(),
                                   max_size=3),
        "queue": st.sampled_from(["default", "mail", "reports"]),
        "priority": st.integers(-100, 100),
        "max_attempts": st.integers(1, 10),
        "unique_key": st.sampled_from(["a", "b", "c"]),
    },
)

COMPARED = ("kind", "queue", "payload", "priority", "max_attempts", "unique_key", "state")


def stored(db: Database) -> list[tuple[Any, ...]]:
    with Session(db.engine) as session:
        rows: list[Row[Any]] = list(session.execute(select(*(getattr(app.Job, c) for c in COMPARED))
                                                    .order_by(app.Job.id)))
        return [tuple(r) for r in rows]


def clear(db: Database) -> None:
    with Session(db.engine) as session, session.begin():
        session.execute(delete(app.Job))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(job_items, max_size=12))
def test_any_list_of_jobs_enqueued_async_reads_back_as_through_the_sync_path(
    db: Database, items: list[dict[str, Any]]
) -> None:
    clear(db)
    with Session(db.engine) as session, session.begin():
        sync_count = queue.enqueue_many(session, items)
    through_sync = stored(db)
    clear(db)

    async def scenario(engine: AsyncEngine) -> int:
        async with AsyncSession(engine) as session, session.begin():
            return await queue.aio.enqueue_many(session, items)

    assert run(db, scenario) == sync_count == len(through_sync)
    assert stored(db) == through_sync


# -- without the asyncio extra -----------------------------------------------------------------------------

WITHOUT_GREENLET = """
import asyncio, os, sys
sys.modules["greenlet"] = None  # as if the asyncio extra were not installed
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sqla_jobs import ConfigError
from tests.app import queue
engine = create_engine(os.environ["SQLA_JOBS_URL"])
with Session(engine) as session, session.begin():
    assert queue.enqueue_many(session, [{"kind": "noop"}]) == 1
try:
    asyncio.run(queue.aio.enqueue_many(None, []))
except ConfigError as exc:
    print(exc)
"""


def test_apps_without_the_asyncio_extra_import_and_enqueue_and_queue_aio_says_what_to_install(db: Database) -> None:
    result = subprocess.run([sys.executable, "-c", WITHOUT_GREENLET], env=db.env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "queue.aio needs SQLAlchemy's asyncio support: pip install 'sqla-jobs[asyncio]'" in result.stdout
    assert len(payloads(db)) == 1


def test_an_async_session_adds_a_graph_and_a_bad_one_fails_at_flush(db: Database) -> None:
    """``depends_on`` through ``AsyncSession``: the flush's checks, locks and edges run in the greenlet."""
    from sqlalchemy import select

    from sqla_jobs import InvalidJob

    async def scenario(engine: AsyncEngine) -> tuple[str, str, list[int]]:
        async with AsyncSession(engine, expire_on_commit=False) as session, session.begin():
            up = app.Job(kind="noop", payload={})
            down = app.Job(kind="noop", payload={}, depends_on=[up])
            session.add(down)
        async with AsyncSession(engine, expire_on_commit=False) as session, session.begin():
            by_id = app.Job(kind="noop", payload={}, depends_on=[up.id])
            session.add(by_id)
        try:
            async with AsyncSession(engine) as session, session.begin():
                session.add(app.Job(kind="noop", payload={}, depends_on=[10**9]))
        except InvalidJob as exc:
            assert "not in table" in str(exc)
        else:
            raise AssertionError("a dependency on an unknown id was accepted")
        async with AsyncSession(engine) as session:
            states = dict((await session.execute(select(app.Job.id, app.Job.state))).all())
        return states[down.id], states[by_id.id], sorted(states)

    down_state, by_id_state, ids = run(db, scenario)
    assert (down_state, by_id_state) == ("blocked", "blocked")
    assert len(ids) == 3  # the refused job left nothing


def test_an_async_session_makes_a_batch_grows_it_by_copy_and_reads_it(db: Database) -> None:
    """``Batch`` members through ``AsyncSession`` (the flush) and ``queue.aio.enqueue_many(..., batch=)`` (COPY on
    psycopg's async connection on PostgreSQL), then ``queue.aio.batch`` and ``queue.aio.batches``."""
    from sqla_jobs import Batch, InvalidJob

    async def scenario(engine: AsyncEngine) -> tuple[Any, Any]:
        batch = Batch(on_complete=app.Job(kind="noop", payload={}))
        async with AsyncSession(engine, expire_on_commit=False) as session, session.begin():
            session.add_all(app.Job(kind="noop", payload={}, batch=batch) for _ in range(2))
        async with AsyncSession(engine) as session, session.begin():
            assert await app.queue.aio.enqueue_many(session, [{"kind": "noop", "payload": {}}] * 3,
                                                    batch=batch.id) == 3
        try:
            async with AsyncSession(engine) as session, session.begin():
                session.add(app.Job(kind="noop", payload={}, batch=10**9))
        except InvalidJob as exc:
            assert "does not exist" in str(exc)
        else:
            raise AssertionError("a member of an unknown batch was accepted")
        async with AsyncSession(engine) as session:
            status = await app.queue.aio.batch(session, batch.id)
            [listed] = await app.queue.aio.batches(session)
            assert listed.id == batch.id
            callback = await session.get(app.Job, batch.on_complete.id)
            return status, callback

    status, callback = run(db, scenario)
    assert (status.total, status.waiting, callback.state, callback.waiting_for) == (5, 5, "blocked", 5)
