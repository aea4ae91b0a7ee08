"""``AsyncWorker``: the worker on an ``AsyncEngine`` and one event loop (aiosqlite, psycopg async, aiomysql).

Each test runs the real worker on every backend and reads the outcome back with a
sync engine: async and plain handlers, failures, retries, dead letters, snoozes,
cancels and hooks as under the threaded worker; transactional async handlers whose
writes commit with the job's completion or not at all; a timeout that really stops
an async handler; cancelling the task that awaits ``run()`` as a graceful stop.
The multi-process and crash scenarios are the reliability suite's, run for this
worker too (tests/reliability, the ``flavour`` fixture).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session

from sqla_jobs import AsyncWorker, ConfigError, JobEvent
from tests import app, forkserver
from tests.conftest import ROOT, Database

T = TypeVar("T")
queue = app.queue


def run(db: Database, scenario: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """Run ``scenario`` with an async engine on ``db``'s database (its async driver), in a fresh event loop."""

    async def main() -> T:
        url = queue.driver(db.engine).async_url(make_url(db.url))
        engine = create_async_engine(url, **({"connect_args": {"timeout": 60}} if db.backend == "sqlite" else {}))
        try:
            return await scenario(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def enqueue(db: Database, *jobs: tuple[str, dict[str, Any], int]) -> list[int]:
    with Session(db.engine) as session, session.begin():
        made = [queue.enqueue(session, kind, payload, max_attempts=attempts) for kind, payload, attempts in jobs]
        session.flush()
        return [job.id for job in made]


def states(db: Database) -> dict[int, tuple[str, int]]:
    with Session(db.engine) as session:
        jobs = {j.id: (j.state, j.attempts) for j in session.scalars(select(app.Job))}
        dead = {j.id: ("dead", j.attempts) for j in session.scalars(select(app.DeadJob))}
    return {**jobs, **dead}


def effects(db: Database) -> list[tuple[int, str]]:
    with Session(db.engine) as session:
        return sorted((e.job_id, e.event) for e in session.scalars(select(app.Effect)))


def once_rows(db: Database) -> set[int]:
    with Session(db.engine) as session:
        return set(session.scalars(select(app.Once.job_id)))


def test_async_and_plain_handlers_run_with_every_outcome_written_and_heard(db: Database) -> None:
    heard: list[JobEvent] = []
    for event in ("started", "finished", "failed", "dead_letter", "snoozed", "cancelled"):
        queue.on(event)(heard.append)
    try:
        ids = enqueue(
            db,
            *[("async_record", {"sleep": 0.2}, 1) for _ in range(6)],
            ("noop", {}, 1),
            ("fail", {}, 2),
            ("cancel", {}, 3),
            ("once", {}, 1),
            ("async_once", {}, 1),
            ("async_once", {"fail": True}, 1),
        )

        async def scenario(engine: AsyncEngine) -> int:
            worker = AsyncWorker(engine, queue, concurrency=8, poll_interval=0.05)
            await worker.run(burst=True)
            return worker.processed

        processed = run(db, scenario)
    finally:
        for event in ("started", "finished", "failed", "dead_letter", "snoozed", "cancelled"):
            queue.off(event, heard.append)
    records, (noop, fail, cancel, once, async_once, async_fails) = ids[:6], ids[6:]
    found = states(db)
    assert all(found[i] == ("finished", 1) for i in [*records, noop, once, async_once])
    assert found[fail] == ("dead", 2)
    assert found[async_fails] == ("dead", 1)
    assert found[cancel][0] == "cancelled"
    # The writes of the transactional runs that finished committed; the failed one's rolled back.
    assert once_rows(db) == {once, async_once}
    assert effects(db) == sorted([(i, e) for i in records for e in ("start", "finish")])
    assert processed == 13  # 12 jobs, plus fail's retry
    names = [(e.name, e.id) for e in heard]
    assert names.count(("finished", async_once)) == 1 and ("dead_letter", async_fails) in names
    assert ("failed", fail) in names and ("dead_letter", fail) in names
    assert sum(name == "started" for name, _ in names) == 13


def test_async_handlers_run_concurrently_on_one_loop(db: Database) -> None:
    """Six handlers that each await 1 s finish in far less than 6 s: they overlap."""
    ids = enqueue(db, *[("async_record", {"sleep": 1.0}, 1) for _ in range(6)])

    async def scenario(engine: AsyncEngine) -> None:
        await AsyncWorker(engine, queue, concurrency=6, poll_interval=0.05).run(burst=True)

    run(db, scenario)
    with Session(db.engine) as session:
        # The rows' ids give their order (MariaDB's timestamps here have whole seconds).
        order = {(e.job_id, e.event): e.id for e in session.scalars(select(app.Effect))}
    starts = [order[(i, "start")] for i in ids]
    # Every job started before any other finished: all six were awaiting at the same time.
    assert max(starts) < min(order[(i, "finish")] for i in ids)


def test_a_timed_out_async_handler_is_really_stopped(db: Database) -> None:
    [job] = enqueue(db, ("async_hang", {"seconds": 30}, 1))

    async def scenario(engine: AsyncEngine) -> None:
        await AsyncWorker(engine, queue, concurrency=2, poll_interval=0.05).run(burst=True)

    run(db, scenario)
    assert states(db)[job] == ("dead", 1)
    with Session(db.engine) as session:
        error = session.get(app.DeadJob, job).last_error  # type: ignore[union-attr]
    assert "timeout" in (error or "")
    # Its task was cancelled (CancelledError at its await): it never reached its last line.
    assert effects(db) == [(job, "start"), (job, "stopped")]


def test_cancelling_the_task_that_runs_the_worker_lets_running_jobs_finish(db: Database) -> None:
    [job] = enqueue(db, ("async_record", {"sleep": 1.0}, 1))

    async def scenario(engine: AsyncEngine) -> bool:
        worker = AsyncWorker(engine, queue, concurrency=2, poll_interval=0.05, grace=30)
        task = asyncio.create_task(worker.run())
        while (job, "start") not in effects(db):
            await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert run(db, scenario), "the cancellation goes on once the worker stopped"
    assert states(db)[job] == ("finished", 1)
    assert effects(db) == [(job, "finish"), (job, "start")]


def test_stop_after_the_grace_period_gives_running_jobs_back(db: Database) -> None:
    # A handler with no timeout of its own that would run for 30 s: only the grace period can end it,
    # however slowly a loaded machine gets to the stop.
    [job] = enqueue(db, ("async_record", {"sleep": 30}, 3))

    async def scenario(engine: AsyncEngine) -> None:
        worker = AsyncWorker(engine, queue, concurrency=2, poll_interval=0.05, grace=0.1)
        task = asyncio.create_task(worker.run())
        while (job, "start") not in effects(db):
            await asyncio.sleep(0.02)
        worker.stop()
        await task

    started = time.monotonic()
    run(db, scenario)
    # Given back at the end of the grace period: pending again, the interrupted attempt refunded.
    assert states(db)[job] == ("pending", 0)
    assert time.monotonic() - started < 20, "the stop waited for the handler instead of giving its job back"


def test_the_sync_engine_is_refused_with_a_pointer_to_worker(db: Database) -> None:
    with pytest.raises(ConfigError, match="AsyncEngine"):
        AsyncWorker(db.engine, queue)  # type: ignore[arg-type]


def test_a_threaded_worker_fails_async_transactional_jobs_saying_which_worker_runs_them(db: Database) -> None:
    from sqla_jobs import Worker

    [job] = enqueue(db, ("async_once", {}, 1))
    Worker(create_engine(db.url), queue, concurrency=1).run(burst=True, install_signals=False)
    with Session(db.engine) as session:
        dead = session.get(app.DeadJob, job)
    assert dead is not None and "AsyncWorker" in (dead.last_error or "")
    assert once_rows(db) == set()


def test_the_fastapi_recipe_runs_end_to_end_on_postgresql(pg: Database, tmp_path: Path) -> None:
    """docs/howto/fastapi.md as printed, on psycopg's async driver (the doc test runs it on aiosqlite)."""
    from tests.test_docs import blocks

    python = [body for lang, body in blocks("howto/fastapi.md") if lang == "python"]
    (tmp_path / "shop.py").write_text(python[0])
    (tmp_path / "main.py").write_text("\n".join(python[1:]))
    env = {**os.environ, "SHOP_DB": pg.url, "PYTHONPATH": str(ROOT)}
    result = forkserver.run([sys.executable, "main.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "receipt sent" in result.stdout


def test_on_postgresql_a_notify_wakes_the_async_worker_long_before_its_poll(pg: Database) -> None:
    async def scenario(engine: AsyncEngine) -> float:
        # Idle, its next poll and heartbeat are a minute away (a heartbeat also ends the wait).
        worker = AsyncWorker(engine, queue, concurrency=2, poll_interval=60, lease=300, heartbeat=60)
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(1.0)
        [job] = await asyncio.to_thread(enqueue, pg, ("async_record", {}, 1))
        started = asyncio.get_running_loop().time()
        while states(pg)[job][0] != "finished":
            assert asyncio.get_running_loop().time() - started < 10, "not woken by the NOTIFY"
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return asyncio.get_running_loop().time() - started

    assert run(pg, scenario) < 10


def listen_backends(db: Database, worker_name: str) -> list[int]:
    """The server pids of the worker's LISTEN connections (pg_stat_activity shows their last statement)."""
    query = text("SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND application_name = :name")
    with db.engine.connect() as conn:
        return list(conn.execute(query, {"name": f"sqla-jobs worker {worker_name}"[:63]}).scalars())


def test_on_postgresql_the_async_worker_listens_on_its_loop_and_survives_its_listen_connection_killed(
    pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """LISTEN is a task on the worker's event loop (drivers/postgresql/async_listen.py), not a thread: a notification
    wakes the worker in the loop's own thread. Killing its connection costs one reconnect, after which
    a NOTIFY wakes the worker again (its poll and heartbeat are a minute away)."""

    async def until(check: Callable[[], Awaitable[bool]], what: str, seconds: float = 10.0) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while not await check():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.05)

    async def scenario(engine: AsyncEngine) -> None:
        worker = AsyncWorker(engine, queue, concurrency=2, poll_interval=60, lease=300, heartbeat=60)
        task = asyncio.create_task(worker.run())

        async def listening() -> bool:
            return bool(await asyncio.to_thread(listen_backends, pg, worker.name))

        async def finished(job: int) -> bool:
            return (await asyncio.to_thread(states, pg))[job][0] == "finished"

        try:
            await until(listening, "the worker to LISTEN")
            assert not [t.name for t in threading.enumerate() if t.name == "sqla-jobs-listen"], "a listener thread"
            [first] = await asyncio.to_thread(enqueue, pg, ("async_record", {}, 1))
            await until(lambda: finished(first), "a NOTIFY to wake the worker")

            [pid] = await asyncio.to_thread(listen_backends, pg, worker.name)
            with pg.engine.connect() as conn:
                assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
            async def back() -> bool:
                return "LISTEN connection is back" in caplog.text

            await until(back, "the LISTEN connection to come back")
            await until(listening, "the worker to LISTEN again")
            assert await asyncio.to_thread(listen_backends, pg, worker.name) != [pid]
            [second] = await asyncio.to_thread(enqueue, pg, ("async_record", {}, 1))
            await until(lambda: finished(second), "a NOTIFY on the new LISTEN connection to wake the worker")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        async def closed() -> bool:
            return not await asyncio.to_thread(listen_backends, pg, worker.name)

        await until(closed, "the LISTEN connection to close with the worker")

    with caplog.at_level(logging.INFO, logger="sqla_jobs.worker"):
        run(pg, scenario)
    assert "LISTEN connection failed" in caplog.text


def test_the_cli_picks_the_async_worker_for_an_async_url(db: Database) -> None:
    from tests.conftest import run_cli

    ids = enqueue(db, ("async_once", {}, 1), ("async_record", {}, 1), ("once", {}, 1))
    url = queue.driver(db.engine).async_url(make_url(db.url)).render_as_string(hide_password=False)
    result = run_cli("worker", "--burst", "--app", "tests.app:queue", "--url", url, env=db.env())
    assert result.returncode == 0, result.stderr
    assert "started (async)" in result.stderr
    assert [states(db)[i] for i in ids] == [("finished", 1)] * 3
    assert once_rows(db) == {ids[0], ids[2]}  # through its AsyncSession, and the plain one's Session


def test_on_sqlite_the_worker_starts_while_a_coroutine_on_its_loop_is_writing(tmp_path: Path) -> None:
    """The WAL switch refused while the app writes (tests/test_worker.py has the threaded case): here the app's
    writer is a coroutine on the worker's own loop, which must go on and commit while the worker tries again."""
    import aiosqlite

    path = tmp_path / "jobs.db"
    db = Database("sqlite", f"sqlite:///{path}", create_engine(f"sqlite:///{path}"))
    app.Base.metadata.create_all(db.engine)  # the app's create_all: the file is not in WAL mode yet
    [job_id] = enqueue(db, ("noop", {}, 1))

    async def scenario(engine: AsyncEngine) -> int:
        holding = asyncio.Event()

        async def app_writes() -> None:
            async with aiosqlite.connect(path, isolation_level=None) as conn:
                await conn.execute("BEGIN IMMEDIATE")
                await conn.execute("INSERT INTO effects (job_id, attempt, event, pid) VALUES (0, 0, 'app', 0)")
                holding.set()
                await asyncio.sleep(1.0)
                await conn.execute("COMMIT")

        writer = asyncio.create_task(app_writes())
        await holding.wait()
        worker = AsyncWorker(engine, queue, concurrency=2, poll_interval=0.05)
        await worker.run(burst=True)
        await writer  # committed: the worker's retries let the loop run it
        return worker.processed

    assert run(db, scenario) == 1
    assert states(db)[job_id] == ("finished", 1)
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    db.engine.dispose()
