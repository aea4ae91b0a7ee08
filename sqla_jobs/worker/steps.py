"""What a worker gives a durable job's run for its steps (``sqla_jobs._durable.DurableStore``).

A run's steps, sleeps and waits read and write in short transactions of their own (a transactional
handler's steps write through its session instead): ``StepStore`` for the threaded worker, and
``AsyncStepStore`` for the async one, whose engine is async (a plain handler's thread reaches it
through the worker's event loop, as ``upstream_results`` does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from .._durable import Book
from ..drivers.base import Driver

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from .._app import JobQueue

__all__ = ["AsyncStepStore", "StepStore"]


class StepStore:
    """Reads and write transactions on the worker's engine; ``step_limit``: the most a step's value may take."""

    def __init__(self, engine: Engine, driver: Driver, step_limit: int, queue: JobQueue[Any, Any]) -> None:
        self.engine, self.driver, self.step_limit, self.queue = engine, driver, step_limit, queue
        self.kinds: set[str] = set()  # learnt from the runs (sqla_jobs._durable._book): no setting to forget

    @property
    def tracing(self) -> Any:
        """The app's tracing (``sqla_jobs.otel``), or None: steps, sleeps and waits become spans when it is on."""
        return self.queue.tracing

    def prefetch(self, runs: list[Any]) -> None:
        """Give each run (a ``JobContext`` of a durable kind, just claimed) its job's steps, all read in one statement.

        Each run would read its own as it starts: one round trip per job, on a handler thread, which among dozens
        of threads waits for the GIL after each (resuming 10,000 woken waiters took 6 ms a read). The job is this
        worker's now: nothing else writes its steps until its run ends. If the read fails, each run reads its own.
        """
        if not runs:
            return
        try:
            with self.engine.connect() as conn:
                found = self.driver.jobs_steps(conn, [ctx.id for ctx in runs])
        except SQLAlchemyError:
            return
        for ctx in runs:
            ctx._book = Book({row.name: row for row in found.get(ctx.id, ())})

    def read(self, action: Callable[[Connection], Any]) -> Any:
        with self.engine.connect() as conn:
            return action(conn)

    def write(self, action: Callable[[Connection], Any]) -> Any:
        with self.driver.write(self.engine) as conn:
            return action(conn)

    async def read_async(self, action: Callable[[Connection], Any]) -> Any:
        return await asyncio.to_thread(self.read, action)

    async def write_async(self, action: Callable[[Connection], Any]) -> Any:
        return await asyncio.to_thread(self.write, action)


class AsyncStepStore(StepStore):
    """The async worker's: on its ``AsyncEngine``, from its event loop (a plain handler's thread goes through it)."""

    def __init__(self, engine: AsyncEngine, driver: Driver, step_limit: int, loop: asyncio.AbstractEventLoop,
                 queue: JobQueue[Any, Any]) -> None:
        super().__init__(engine.sync_engine, driver, step_limit, queue)
        self.async_engine, self.loop = engine, loop

    def read(self, action: Callable[[Connection], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(self.read_async(action), self.loop).result()

    def write(self, action: Callable[[Connection], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(self.write_async(action), self.loop).result()

    async def read_async(self, action: Callable[[Connection], Any]) -> Any:
        async with self.async_engine.connect() as conn:
            return await conn.run_sync(action)

    async def write_async(self, action: Callable[[Connection], Any]) -> Any:
        def written(conn: Connection) -> Any:
            self.driver.begin_write(conn)
            result = action(conn)
            conn.commit()
            return result

        async with self.async_engine.connect() as conn:
            return await conn.run_sync(written)
