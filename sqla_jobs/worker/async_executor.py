"""The async worker's runs: one task per claimed job on the worker's event loop.

``AsyncExecutor`` is ``Executor`` with its threads replaced, nothing else: the
bookkeeping the control loop reads and changes (``running``, ``live``,
``abandon``, ``deliver_cancel``, ``timed_out``, ``collect``, progress) is
inherited unchanged, and so are the rules that turn what a handler did into an
``Outcome`` (``_raised``, ``_succeeded``, ``_failed``). What differs is how a
run executes (``_dispatch`` starts a task instead of queueing for a thread):

* an ``async def`` handler is awaited in its task, under ``asyncio.wait_for``
  for its kind's timeout; ``run.task`` is that task, so a timeout, a lost lease
  or a cancel request cancels it (``Executor._interrupt``): the handler is
  really stopped at its next ``await``, not merely disowned;
* a plain handler runs on a thread pool of ``concurrency`` threads (the task
  awaits it); like the threaded worker's, it can only be told to stop
  (``current_job().cancelled``), not stopped;
* a transactional ``async def`` handler gets an ``AsyncSession``
  (``current_job().session``) whose transaction also finishes the job, fenced by
  the claim token, exactly as a sync one does (``Executor._execute_in_transaction``):
  its writes and the job's completion commit together or not at all;
* a transactional plain handler runs as under the threaded worker, on the
  thread pool, in a ``Session`` of a sync engine on the same database (the
  async URL's sync twin, ``Driver.sync_url``: a thread cannot use the loop's
  connections), made by ``AsyncWorker`` only for apps that have such handlers.

Every statement is still the driver's: the sync driver methods run on the
connection behind the ``AsyncSession`` through ``run_sync``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from .._app import JobEvent, JobQueue
from .._context import _current
from ..drivers.base import Driver, Fence
from ..errors import JobParked
from .async_wake import AsyncWake
from .executor import Executor, Outcome, Run, _ClaimLost, outcome_of
from .outage import DatabaseKey, watch
from .steps import AsyncStepStore

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


__all__ = ["AsyncExecutor"]


class AsyncExecutor(Executor):
    """Runs claimed jobs as tasks on ``loop`` (touched only from that loop's thread: the control loop
    runs there too, in a greenlet, so the inherited bookkeeping needs no more locking than before)."""

    def __init__(self, engine: AsyncEngine, queue: JobQueue[Any, Any], driver: Driver, concurrency: int,
                 worker_name: str, database: DatabaseKey, wake: AsyncWake, loop: asyncio.AbstractEventLoop, *,
                 sync_engine: Engine | None = None, count_queues: bool = False) -> None:
        # ``sync_engine``: the plain transactional handlers' (``Executor._execute_in_transaction`` uses it).
        super().__init__(sync_engine or engine.sync_engine, queue, driver, concurrency, worker_name, database,
                         wake, count_queues=count_queues)  # type: ignore[arg-type]  # Event's three methods
        self.async_engine = engine
        self._loop = loop
        self.steps = AsyncStepStore(engine, driver, self._result_limit, loop, queue)
        # Plain handlers' threads, started on demand up to ``concurrency``; the calls they take.
        self._calls: stdlib_queue.SimpleQueue[Any] = stdlib_queue.SimpleQueue()
        self._idle = 0  # threads waiting for a call, or started for one and not yet waiting
        self._idle_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Outcome]] = set()  # a strong reference: the loop keeps only weak ones

    def read(self, statement: Callable[[Driver, Connection], Any]) -> Any:
        """For a plain handler, on its thread: the read runs on the worker's event loop (its engine is async)."""
        return asyncio.run_coroutine_threadsafe(self.read_async(statement), self._loop).result()

    def prefetch_traces(self, runs: list[Run]) -> None:
        """Nothing: each task reads its own context, awaiting on the loop (no thread waits for the GIL here), and
        ``read`` from the control loop, which runs on the loop's own thread, would wait for itself."""

    async def read_async(self, statement: Callable[[Driver, Connection], Any]) -> Any:
        async with self.async_engine.connect() as conn:
            return await conn.run_sync(lambda sync: statement(self.driver, sync))


    def start(self) -> None:
        """Nothing to start: a task is made per run."""

    def shutdown(self) -> None:
        """Let idle handler threads end (one still in a handler ends when it returns)."""
        for _ in self._threads:
            self._calls.put(None)

    def has_outcomes(self) -> bool:
        return not self._done.empty()

    def _dispatch(self, run: Run) -> None:
        tracing = self.queue.tracing  # sqla_jobs.otel: None unless instrumented
        task = self._loop.create_task(self._execute_task(run) if tracing is None else tracing.run_async(
            run, self.trace_reader_async(run), partial(self._execute_task, run)))
        self._tasks.add(task)
        task.add_done_callback(partial(self._task_done, run))
        if run.handler is not None and run.handler.is_async:
            # Only an async handler can be interrupted; a plain one is told through its context.
            run.loop, run.task = self._loop, task

    def _task_done(self, run: Run, task: asyncio.Task[Outcome]) -> None:
        """The run's outcome, for the control loop; wake it as the thread pool's runs do."""
        self._tasks.discard(task)
        try:
            outcome = task.result()
        except BaseException as exc:  # cancelled before its handler started (its first step never ran)
            outcome = outcome_of(run, run.started)("error", f"{type(exc).__name__}: the run was stopped before "
                                                   "its handler started")
        run.returned = True  # its handler is done: self-fencing leaves its outcome alone
        self._done.put((run, outcome))
        waiting = self._done.qsize()
        if (waiting == 1 or outcome.result != "ok" or waiting * 2 >= self.concurrency
                or waiting >= self.live_count):
            self._wake.set()

    async def _execute_task(self, run: Run) -> Outcome:
        if run.abandoned:  # given back (shutdown) before it started: it must not start now
            return Outcome(run.job, "lost", 0.0)
        job, ctx, handler = run.job, run.ctx, run.handler
        started = time.monotonic()
        outcome = outcome_of(run, started)
        if handler is None:
            return outcome("error", f"UnknownKind: {self.queue.unknown_kind_message(job.kind)}")
        if self.queue.listens("started"):
            self.queue.emit(JobEvent("started", job.id, job.kind, job.queue, job.attempt, job.max_attempts))
        _current.set(ctx)  # in this task's own context (a copy): nothing to reset
        dropped: set[Any] = set()
        try:
            with watch() as dropped:
                if handler.transactional:
                    if handler.is_async:
                        await self._execute_in_async_transaction(run)
                    else:
                        await self._in_thread(self._execute_in_transaction, run)
                    return outcome("committed")
                if handler.is_async:
                    value = await asyncio.wait_for(handler.fn(job.payload), handler.timeout)
                else:
                    value = await self._in_thread(handler.fn, job.payload)
            if value is None and not self.progress and not run.cancel_requested:
                return Outcome(job, "ok", time.monotonic() - started)  # the common case, kept short
            return self._succeeded(run, outcome("ok"), value)
        except BaseException as exc:
            return self._raised(run, exc, dropped, outcome)

    def _in_thread(self, fn: Callable[..., Any], arg: Any) -> asyncio.Future[Any]:
        """``fn(arg)`` on one of the handler threads, in a copy of this task's context (``current_job()``
        and the outage watch); a future of its result."""
        future = self._loop.create_future()
        self._calls.put((contextvars.copy_context(), fn, arg, future))
        with self._idle_lock:
            start = self._idle < self._calls.qsize() and len(self._threads) < self.concurrency
            if start:
                self._idle += 1  # counted now, so the next call does not start another for this one
        if start:
            thread = threading.Thread(target=self._handler_thread, daemon=True, name="sqla-jobs-handler")
            self._threads.append(thread)
            thread.start()
        return future

    def _handler_thread(self) -> None:
        """Daemon threads, as the threaded worker's: a handler still running when the worker has
        stopped (given back after the grace period) must not keep the process from exiting."""
        first = True
        while True:
            if not first:
                with self._idle_lock:
                    self._idle += 1
            first = False
            item = self._calls.get()
            with self._idle_lock:
                self._idle -= 1
            if item is None:
                return
            context, fn, arg, future = item
            try:
                result, error = context.run(fn, arg), None
            except BaseException as exc:
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for it any more
                self._loop.call_soon_threadsafe(_settle, future, result, error)

    async def _execute_in_async_transaction(self, run: Run) -> None:
        """The handler's writes through its ``AsyncSession`` and the job's completion commit together."""
        from sqlalchemy.ext.asyncio import AsyncSession

        fence, handler = run.job.fence, run.handler
        async with AsyncSession(self.async_engine) as session:
            await session.run_sync(lambda s: self.driver.begin_write(s.connection()))
            run.ctx.session = session  # type: ignore[assignment]  # documented: an AsyncSession here
            try:
                try:
                    value = await asyncio.wait_for(handler.fn(run.job.payload), handler.timeout)
                except JobParked:  # its writes and steps commit, fenced, without finishing the job
                    await session.flush()
                    if not await session.run_sync(lambda s: self.driver.hold(s.connection(), fence)):
                        raise _ClaimLost() from None
                    self._before_commit(run, parking=True)
                    await session.commit()
                    raise
                await session.flush()
                result = None if value is None else self._checked_result(value)
                progress = run.ctx.progress if self.progress.pop(fence, None) is not None else None
                if run.abandoned or not await session.run_sync(self._finish_in, fence, result, progress):
                    raise _ClaimLost()
                self._before_commit(run)
            except BaseException:
                await session.rollback()
                raise
            finally:
                run.ctx.session = None
            await session.commit()

    def _finish_in(self, session: Session, fence: Fence, result: Any, progress: Any) -> bool:
        """In the handler's transaction: store its result and progress, and finish the job (fenced)."""
        conn = session.connection()
        if result is not None or progress is not None:
            self.driver.set_results(conn, [(fence, result, progress)])
        return bool(self.driver.finish(conn, [fence]))


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # its task was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
