"""The reads a run makes through its executor: a handler's graph or batch (``current_job().upstreams()``,
``batch()``), and, with tracing on (``sqla_jobs.otel``), its job's stored trace context.

The trace contexts of one claim's runs are read in one statement when the claim is submitted (``prefetch_traces``,
from ``Executor.flush``), not by each run on its handler thread: among dozens of threads each such read waited
milliseconds for the GIL, and a traced drain ran at a third of an untraced one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from ..drivers.base import Driver

if TYPE_CHECKING:
    from .runs import Run

__all__ = ["RunReads"]


class RunReads:
    """A mixin of ``Executor``: reads on its engine, one connection each."""

    engine: Engine
    driver: Driver

    def read(self, statement: Callable[[Driver, Connection], Any]) -> Any:
        """A handler's read of its graph or batch (``current_job().upstreams()``, ``batch()``): one connection."""
        with self.engine.connect() as conn:
            return statement(self.driver, conn)

    async def read_async(self, statement: Callable[[Driver, Connection], Any]) -> Any:
        return await asyncio.to_thread(self.read, statement)

    def trace_contexts(self, ids: list[int]) -> dict[int, dict[str, str]]:
        """The trace contexts stored with these jobs, by id (read only when tracing is on: ``sqla_jobs.otel``)."""
        return self.read(lambda driver, conn: driver.trace_contexts(conn, ids))  # type: ignore[no-any-return]

    async def trace_contexts_async(self, ids: list[int]) -> dict[int, dict[str, str]]:
        return await self.read_async(lambda driver, conn: driver.trace_contexts(conn, ids))  # type: ignore[no-any-return]

    def prefetch_traces(self, runs: list[Run]) -> None:
        """Give each run the stored contexts of its claim, read in one statement. If the read fails, each run
        reads its own as it starts (and goes on without a parent if that fails too: ``sqla_jobs.otel``)."""
        try:
            found = self.trace_contexts([run.job.id for run in runs])
        except Exception:  # the database is away: nothing is lost, the runs try again themselves
            return
        for run in runs:
            run.traces = found

    def trace_reader(self, run: Run) -> Callable[[], dict[int, dict[str, str]]]:
        """What the run's tracing reads its job's stored context with: the claim's, or its own read."""
        found = run.traces
        return (lambda: found) if found is not None else (lambda: self.trace_contexts([run.job.id]))

    def trace_reader_async(self, run: Run) -> Callable[[], Awaitable[dict[int, dict[str, str]]]]:
        """``trace_reader`` for the async executor's runs."""
        found = run.traces

        async def claims() -> dict[int, dict[str, str]]:
            return found or {}

        return claims if found is not None else (lambda: self.trace_contexts_async([run.job.id]))
