"""The worker's handler threads: they run user code and nothing else.

The control loop hands the executor each claimed job (``submit``); the handler is resolved there, once, and
travels with the run (``Run.handler``) to the thread that executes it, so no thread looks anything up by key. A
thread runs the handler with its job context set (``current_job()``), inside ``_outage.watch()`` so a failure
caused by the queue database dropping is told apart from the handler's own, and puts the ``Outcome`` on a queue
the control loop drains with ``collect``. A transactional handler runs in a session whose commit also finishes
the job (``Driver.finish``, fenced by the claim token).

A handler's return value (when not None) is checked by the payload rules and travels with its ``Outcome``
(``value``), as does the last progress value not yet written; such outcomes are finished by
``Store.finish_with_results``, the rest by the batched ``finish_and_claim`` as before. A cancel request that
reached a run (``deliver_cancel``: its context's ``cancelled`` event set, an async handler's task cancelled)
turns whatever the handler then does into a ``cancel`` outcome.

A run can be abandoned (timed out, lease lost, given back at shutdown): its thread may go on, but its result is
discarded. ``abandon`` and a transactional run starting its commit are ordered by one lock, so a run that holds
its fenced finish is never abandoned: its fate is its commit's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue as stdlib_queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from .._app import JobEvent, JobQueue
from .._context import JobContext, _current
from .._payload import encode_value
from ..drivers.base import Claimed, Driver, Fence
from ..errors import ConfigError, InvalidJob, JobCancel, JobParked, JobSnooze
from .outage import DatabaseKey, watch
from .run_reads import RunReads
from .runs import InvalidResult, Outcome, Run, _CancelBeforeCommit, _ClaimLost, outcome_of
from .steps import StepStore

__all__ = ["Executor", "Outcome", "Run"]

log = logging.getLogger("sqla_jobs.worker")


class Executor(RunReads):
    """``concurrency`` handler threads and the runs they hold (touched by the control thread only,
    except ``Run.abandoned``/``finishing``, which the lock orders)."""

    #: Whether runs can start now; the control loop claims nothing while not (the relay's executor: its
    #: broker is unreachable, so jobs wait pending in the table instead of failing).
    accepting = True

    def __init__(self, engine: Engine, queue: JobQueue[Any, Any], driver: Driver, concurrency: int,
                 worker_name: str, database: DatabaseKey, wake: threading.Event, *,
                 count_queues: bool = False) -> None:
        self.engine = engine
        self.queue = queue
        self.driver = driver
        self.concurrency = concurrency
        self.worker_name = worker_name
        self._database = database
        self._wake = wake
        self._todo: stdlib_queue.SimpleQueue[Run | None] = stdlib_queue.SimpleQueue()
        self._done: stdlib_queue.SimpleQueue[tuple[Run, Outcome]] = stdlib_queue.SimpleQueue()
        self.running: dict[Fence, Run] = {}
        # Runs per queue (abandoned ones too: they hold a thread), kept only for per-queue slots.
        self.running_in: dict[str, int] = {}
        self._count_queues = count_queues
        #: Runs whose handler set a progress value not yet written (JobContext.set_progress fills it).
        self.progress: dict[Fence, JobContext] = {}
        self._result_limit = queue.job_model.max_result_bytes
        self.steps = StepStore(engine, driver, self._result_limit, queue)  # a durable job's steps (sqla_jobs._durable)
        self._held: list[Run] = []  # submitted runs of durable kinds or traced apps, until flush reads for them
        self._progress_limit = queue.job_model.max_progress_bytes
        self._fate = threading.Lock()  # orders abandon against a transactional run starting to commit
        self._abandoned = 0  # how many of running were given up on
        self._timed = 0  # how many of running have a timeout to watch
        self._threads: list[threading.Thread] = []

    # -- the control thread's side ---------------------------------------------------

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._thread_main, daemon=True) for _ in range(self.concurrency)]
        for thread in self._threads:
            thread.start()

    def shutdown(self) -> None:
        """Let idle threads end (a thread still in a handler ends when it returns)."""
        for _ in self._threads:
            self._todo.put(None)

    def submit(self, job: Claimed, now: float) -> Run:
        """Start a claimed job: resolve its handler once and queue the run for a thread."""
        handler = self.queue.handlers.get(job.kind)
        timeout = handler.timeout if handler else None
        fence = job.fence
        # Positional: this runs per job, and keyword arguments cost more (fields as in JobContext).
        ctx = JobContext(job.id, job.kind, job.queue, job.attempt, job.max_attempts, job.payload, self.worker_name,
                         None, None, False, self.progress, fence, self._progress_limit, None, self, self.steps)
        run = Run(job, handler, ctx, now, now + timeout if timeout else None)
        self.running[fence] = run
        if self._count_queues:
            self.running_in[job.queue] = self.running_in.get(job.queue, 0) + 1
        if timeout:
            self._timed += 1
        held = job.kind in self.steps.kinds or self.queue.tracing is not None  # durable or traced: see flush
        (self._held.append if held else self._dispatch)(run)
        return run

    def _dispatch(self, run: Run) -> None:
        """Hand the run to a handler thread (the async executor starts a task instead)."""
        self._todo.put(run)

    def flush(self) -> None:
        """Every run of one claim was submitted: the held ones go once their steps (durable kinds) and trace contexts
        (a traced app) are read, each in one statement for the claim (the relay's executor publishes here)."""
        held, self._held = self._held, []
        if held and self.queue.tracing is not None:  # sqla_jobs.otel
            self.prefetch_traces(held)
        self.steps.prefetch([run.ctx for run in held if run.job.kind in self.steps.kinds])
        for run in held:
            self._dispatch(run)

    def collect(self, take: Callable[[Outcome], None]) -> None:
        """Pass each outcome the threads produced to ``take``; free their slots."""
        while True:
            try:
                run, outcome = self._done.get_nowait()
            except stdlib_queue.Empty:
                return
            self.running.pop(run.job.fence, None)
            if self._count_queues:
                self.running_in[run.job.queue] -= 1
            if run.deadline is not None:
                self._timed -= 1
            if run.abandoned:
                self._abandoned -= 1
                log.warning("job %d %s: handler returned after its run was abandoned; result (%s) discarded",
                            run.job.id, run.job.kind, outcome.result)
                continue
            take(outcome)

    @property
    def live_count(self) -> int:
        """Runs whose result still counts (checked several times per job, so not a list)."""
        return len(self.running) - self._abandoned

    def live(self) -> list[Run]:
        return [run for run in self.running.values() if not run.abandoned]

    def has_outcomes(self) -> bool:
        return not self._done.empty()

    def abandon(self, run: Run) -> bool:
        """Give up on a run: its thread may go on, but its result will be discarded. False, and nothing changed,
        when the run's transaction already holds its fenced finish and is committing: the job is then finished by
        that commit (or its error is written as usual), so discarding the result would misreport it."""
        with self._fate:
            if run.finishing:
                return False
            if not run.abandoned:
                run.abandoned = True
                self._abandoned += 1
                run.ctx.cancelled.set()
                self._interrupt(run)
            return True

    def deliver_cancel(self, run: Run) -> bool:
        """A cancel request reached this run: tell its handler; from now on it ends ``cancelled``. False when its
        transaction already holds the fenced finish and is committing, or it was delivered before."""
        with self._fate:
            if run.finishing or run.cancel_requested or run.abandoned:
                return False
            run.cancel_requested = True
            run.ctx._requested = True
        run.ctx.cancelled.set()
        self._interrupt(run)
        return True

    @staticmethod
    def _interrupt(run: Run) -> None:
        """An async handler gets CancelledError (a sync one only sees the event: threads cannot be stopped)."""
        run.interrupted = True
        task, loop = run.task, run.loop
        if task is not None and loop is not None:
            # RuntimeError: the loop closed meanwhile; its thread ended, nothing is left to cancel.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

    def take_progress(self) -> list[tuple[Fence, Any]]:
        """The progress values set since the last call, of runs still live (the control thread writes them)."""
        taken = []
        while self.progress:
            try:
                fence, ctx = self.progress.popitem()
            except KeyError:  # emptied by a handler thread finishing meanwhile
                break
            run = self.running.get(fence)
            if run is not None and not run.abandoned:
                taken.append((fence, ctx.progress))
        return taken

    def timed_out(self, now: float) -> list[Outcome]:
        """Abandon the runs past their kind's timeout; their failures, to be written."""
        if not self._timed:
            return []
        failed = []
        for run in self.live():
            if run.deadline is not None and now > run.deadline and self.abandon(run):
                timeout = run.deadline - run.started
                failed.append(Outcome(run.job, "error", now - run.started,
                                      f"TimeoutError: handler ran past its {timeout:g}s timeout"))
        return failed

    # -- handler threads -------------------------------------------------------------

    def _thread_main(self) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        while True:
            run = self._todo.get()
            if run is None:
                if loop is not None:
                    loop.close()
                return
            if run.abandoned:  # given back (shutdown) before it started: it must not start now
                outcome = Outcome(run.job, "lost", 0.0)
            else:
                if run.handler is not None and run.handler.is_async and loop is None:
                    loop = asyncio.new_event_loop()
                tracing = self.queue.tracing  # sqla_jobs.otel: None unless instrumented
                outcome = self._execute(run, loop) if tracing is None else tracing.run(
                    run, self.trace_reader(run), partial(self._execute, run, loop))
            run.returned = True  # its handler is done: self-fencing leaves its outcome alone
            self._done.put((run, outcome))
            # Wake the control loop when there is something to do, not after every job: the
            # first outcome starts its flush timer (flush_interval), and a failure, half the
            # threads done (enough to claim a batch) or all of them done calls for a turn now.
            waiting = self._done.qsize()
            if (waiting == 1 or outcome.result != "ok" or waiting * 2 >= self.concurrency
                    or waiting >= self.live_count):
                self._wake.set()

    def _execute(self, run: Run, loop: asyncio.AbstractEventLoop | None) -> Outcome:
        job, ctx, handler = run.job, run.ctx, run.handler
        started = time.monotonic()
        # outcome_of(run, started) makes every outcome but the common success (made only where needed: it
        # is a closure per call, and most runs end in the short path below).
        if handler is None:
            return outcome_of(run, started)("error", f"UnknownKind: {self.queue.unknown_kind_message(job.kind)}")
        if self.queue.listens("started"):
            self.queue.emit(JobEvent("started", job.id, job.kind, job.queue, job.attempt, job.max_attempts))
        token = _current.set(ctx)
        dropped: set[Any]
        try:
            with watch() as dropped:
                if handler.transactional:
                    if handler.is_async:  # its session is an AsyncSession: only AsyncWorker has one
                        raise ConfigError(f"handler {job.kind!r} is async and transactional: "
                                          "run it with AsyncWorker (sqla-jobs worker --async)")
                    self._execute_in_transaction(run)
                    return outcome_of(run, started)("committed")
                if handler.is_async:
                    assert loop is not None
                    task = loop.create_task(asyncio.wait_for(handler.fn(job.payload), handler.timeout))
                    run.loop, run.task = loop, task
                    if run.interrupted:  # cancelled before the task existed
                        task.cancel()
                    value = loop.run_until_complete(task)
                    run.task = None
                else:
                    value = handler.fn(job.payload)
            if value is None and not self.progress and not run.cancel_requested:
                return Outcome(job, "ok", time.monotonic() - started)  # the common case, kept short
            return self._succeeded(run, outcome_of(run, started)("ok"), value)
        except BaseException as exc:
            return self._raised(run, exc, dropped, outcome_of(run, started))
        finally:
            _current.reset(token)

    def _raised(self, run: Run, exc: BaseException, dropped: set[Any],
                outcome: Callable[..., Outcome]) -> Outcome:
        """What a run whose handler (or its transaction) raised ``exc`` became (the async executor's too)."""
        job, handler = run.job, run.handler
        if isinstance(exc, JobSnooze):
            return outcome("snooze", delay=exc.seconds)
        if isinstance(exc, JobParked):  # a durable sleep or wait: a snooze whose delay the park decides
            parked = outcome("snooze")
            parked.park = exc
            return parked
        if isinstance(exc, (JobCancel, _CancelBeforeCommit)):
            return outcome("cancel", f"JobCancel: {exc}")
        if isinstance(exc, _ClaimLost):
            return outcome("lost")
        if isinstance(exc, asyncio.TimeoutError):
            # Only asyncio.wait_for's own timeout (raised from the cancellation it caused) is the
            # kind's timeout; a TimeoutError the handler raised itself (a socket, a lock) is an
            # ordinary failure. On Python 3.11+ asyncio.TimeoutError is the built-in TimeoutError.
            if handler.is_async and handler.timeout is not None and isinstance(exc.__cause__, asyncio.CancelledError):
                return outcome("error", f"TimeoutError: handler ran past its {handler.timeout:g}s timeout")
        elif isinstance(exc, (KeyboardInterrupt, SystemExit)):
            log.warning("job %d %s: handler raised %s; treated as a failure", job.id, job.kind, type(exc).__name__)
        return self._failed(run, outcome(""), exc, dropped)

    def _succeeded(self, run: Run, done: Outcome, value: Any) -> Outcome:
        """The handler returned ``value``: check it as a result; take the last unwritten progress."""
        if done.result != "ok":
            return done  # cancelled on request: neither is stored
        if value is not None:
            try:
                done.value = self._checked_result(value)
            except InvalidResult as exc:
                done.result, done.error = "error", f"InvalidResult: {exc}"
                return done
        if self.progress and self.progress.pop(run.job.fence, None) is not None:
            done.progress = run.ctx.progress
        return done

    def _checked_result(self, value: Any) -> Any:
        """``value`` as it will be stored: checked by the payload rules, and a decoded copy, so changes
        the handler makes to its object later do not leak in. InvalidResult names what is wrong."""
        try:
            return json.loads(encode_value(value, self._result_limit, "the handler's return value"))
        except InvalidJob as exc:
            raise InvalidResult(str(exc)) from None

    def _failed(self, run: Run, failed: Outcome, exc: BaseException, dropped: set[Any]) -> Outcome:
        """The handler raised: an error, or an outage if a connection to the queue database dropped
        or could not be opened during this attempt (see _outage.py): then it is not the job's fault."""
        if run.cancel_requested:  # it stopped on the request (an async handler's CancelledError, or any error)
            failed.result, failed.error = "cancel", f"cancelled on request: {type(exc).__name__}: {exc}".rstrip(": ")
            return failed
        failed.result = "outage" if self._database in dropped else "error"
        failed.error = f"{type(exc).__name__}: {exc}"
        failed.exception = exc
        failed.committing = run.finishing
        return failed

    def _before_commit(self, run: Run, *, parking: bool = False) -> None:
        """The last check of a transactional run before its commit, under the lock ``abandon`` takes: from
        here the job is finished iff that commit succeeds (a run abandoned or asked to cancel rolls back).
        ``parking``: the run parked (a durable sleep or wait): its writes and steps commit, the job stays ours."""
        with self._fate:
            if run.abandoned:
                raise _ClaimLost()
            if run.cancel_requested:
                raise _CancelBeforeCommit("cancel requested before the commit: its writes rolled back")
            run.finishing = not parking

    def _commit_parked(self, run: Run, session: Session) -> None:
        """A transactional handler parked: its writes and steps commit now, fenced, the job left running."""
        session.flush()
        if not self.driver.hold(session.connection(), run.job.fence):
            raise _ClaimLost()
        self._before_commit(run, parking=True)
        session.commit()

    def _execute_in_transaction(self, run: Run) -> None:
        """The handler's writes and the job's completion commit together, or not at all."""
        with Session(self.engine) as session:
            self.driver.begin_write(session.connection())
            run.ctx.session = session
            try:
                try:
                    value = run.handler.fn(run.job.payload)
                except JobParked:
                    self._commit_parked(run, session)
                    raise
                session.flush()
                result = None if value is None else self._checked_result(value)
                progress = run.ctx.progress if self.progress.pop(run.job.fence, None) is not None else None
                conn = session.connection()
                if result is not None or progress is not None:
                    self.driver.set_results(conn, [(run.job.fence, result, progress)])
                if run.abandoned or not self.driver.finish(conn, [run.job.fence]):
                    raise _ClaimLost()
                self._before_commit(run)
            except BaseException:
                session.rollback()
                raise
            finally:
                run.ctx.session = None
            session.commit()
