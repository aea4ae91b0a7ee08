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

from ..drivers.base import Driver

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["AsyncStepStore", "StepStore"]


class StepStore:
    """Reads and write transactions on the worker's engine; ``step_limit``: the most a step's value may take."""

    def __init__(self, engine: Engine, driver: Driver, step_limit: int) -> None:
        self.engine, self.driver, self.step_limit = engine, driver, step_limit

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

    def __init__(self, engine: AsyncEngine, driver: Driver, step_limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(engine.sync_engine, driver, step_limit)
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
