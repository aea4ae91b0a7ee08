"""The worker: claims due jobs, runs their handlers on threads, records the outcome.

::

    Worker(engine, queue, concurrency=8).run()          # until SIGTERM / SIGINT
    Worker(engine, queue).run(burst=True)               # every due job, then return

or ``sqla-jobs worker --url ... --app myapp.jobs:queue``.

One control thread talks to the database; ``concurrency`` handler threads only
run user code. The control loop, on each turn:

1. fails runs that passed their kind's timeout;
2. every ``heartbeat`` seconds extends the leases of running jobs and hands
   jobs whose lease ran out (their worker died) back to the queue;
3. writes failures, snoozes and cancels one by one (retry with backoff, or
   dead-letter on the last attempt);
4. in one round trip, marks the batch of successful runs finished and claims
   jobs for the free threads (``Driver.finish_and_claim``); successes wait up to
   ``flush_interval`` to be batched, and a claim waits until half the threads
   are free, unless the worker is idle; a job whose last worker was lost
   runs alone (claimed only by an idle worker, which then claims nothing
   else until it ends: see sqla_jobs._lost);
5. sleeps until handler threads have something for it, a NOTIFY arrives
   (PostgreSQL) or ``poll_interval`` passes.

A database error on any step is logged and retried: at once after a lost
connection while the server answers (at most half a second apart while it does
not; see ``_reconnect.retry_pause``), with backoff after any other error. Outcomes
not yet written stay in memory and are written after reconnecting. They are
fenced by the claim token, so if the lease ran out meanwhile and another
worker took the job, the stale result is discarded and logged, never applied.
A handler that failed because a connection to the queue database dropped
under it (outage.py) has its attempt refunded, not charged.

On SIGTERM or SIGINT the worker stops claiming, lets running handlers finish
for up to ``grace`` seconds, gives the rest back to the queue (the attempt is
refunded, the job runs again promptly) and returns 0. A second signal exits
at once; the leases cover whatever was running.

With ``prune_after`` (seconds; ``--prune-finished-older-than`` on the command
line) the control loop also deletes finished and cancelled jobs older than
that, one small batch at a time and one worker at a time (see
docs/howto/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue as stdlib_queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from ._context import JobContext, _current
from ._lost import hand_back
from ._outage import database_key, watch
from ._reconnect import retry_pause
from .drivers.base import Claimed, Driver, Fence
from .errors import ConfigError, JobCancel, JobSnooze
from .queue import JobEvent, JobQueue

__all__ = ["Worker"]

log = logging.getLogger("sqla_jobs.worker")


_DETAIL = {
    "finished": "finished",
    "failed": "failed, retry in {o.delay:.0f}s: {o.error}",
    "dead_letter": "failed for good, moved to dead letters: {o.error}",
    "cancelled": "cancelled: {o.error}",
    "snoozed": "snoozed for {o.delay:g}s",
    "lost": "claim lost (lease expired or job taken over): result discarded",
    "outage": "the queue database was unreachable, retry at once, attempt not counted: {o.error}",
}
#: Attempts interrupted by an outage of the queue database are refunded this many times per job; after
#: that they count, so a handler that itself breaks the server (a query that crashes its backend) still
#: ends in the dead letters instead of retrying forever.
MAX_UNCOUNTED_OUTAGES = 10
_UNCOUNTED = "(queue database unreachable, attempt not counted)"
# What hooks hear of each outcome: an outage is a failed run that is retried.
_EVENT = {**{name: name for name in _DETAIL}, "outage": "failed"}


class _ClaimLost(Exception):
    """The job's row was no longer ours when its transactional handler tried to finish it."""


@dataclass
class _Run:
    job: Claimed
    ctx: JobContext
    started: float
    deadline: float | None
    abandoned: bool = False  # timed out, lost or given back: the thread's result is discarded
    # Its transaction holds the fenced finish and is committing: from then on the
    # run's fate is that commit's, so it is never abandoned (see _abandon).
    finishing: bool = False


@dataclass
class _Outcome:
    job: Claimed
    result: str  # ok | committed | error | outage | snooze | cancel | lost
    duration: float
    error: str = ""
    delay: float = 0.0
    written: bool = field(default=False)
    # The failure came after the fenced finish, from the commit itself: the commit may have
    # applied with its reply lost, so a write that finds the job no longer running checks.
    committing: bool = False


class Worker:
    """Runs jobs from ``queue`` using ``engine``. See the module docstring."""

    def __init__(
        self,
        engine: Engine,
        queue: JobQueue[Any, Any],
        *,
        concurrency: int = 4,
        queues: list[str] | None = None,
        lease: float = 60.0,
        heartbeat: float | None = None,
        poll_interval: float = 1.0,
        grace: float = 30.0,
        batch_size: int = 100,
        flush_interval: float = 0.002,
        listen: bool = True,
        name: str | None = None,
        prune_after: float | None = None,
    ) -> None:
        if concurrency < 1:
            raise ConfigError("concurrency must be at least 1")
        if lease <= 0 or poll_interval <= 0 or grace < 0 or batch_size < 1:
            raise ConfigError("lease and poll_interval must be > 0, grace >= 0, batch_size >= 1")
        self.heartbeat = heartbeat if heartbeat is not None else lease / 3
        if not 0 < self.heartbeat <= lease / 3:
            raise ConfigError(f"heartbeat ({self.heartbeat}s) must be > 0 and at most lease / 3 ({lease / 3:g}s)")
        self.engine = engine
        self.queue = queue
        self.sql: Driver = queue.driver(engine)
        self.concurrency = concurrency
        self.queues = queues or None
        self.lease = lease
        self.poll_interval = poll_interval
        self.grace = grace
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.listen = listen and self.sql.supports_listen
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        if prune_after is not None and prune_after < 0:
            raise ConfigError("prune_after must be >= 0 seconds (or None to keep finished jobs)")
        #: Delete finished/cancelled jobs older than this many seconds (see _maybe_prune).
        self.prune_after = prune_after
        self._next_prune = 0.0
        self.sql.harden(engine, self.name)  # keepalives, timeouts, application_name: see the driver

        self._wake = threading.Event()
        self._todo: stdlib_queue.SimpleQueue[Claimed | None] = stdlib_queue.SimpleQueue()
        self._done: stdlib_queue.SimpleQueue[tuple[_Run, _Outcome]] = stdlib_queue.SimpleQueue()
        self._running: dict[Fence, _Run] = {}
        self._fate = threading.Lock()  # orders _abandon against a transactional run starting to commit
        self._database = database_key(engine.url)
        self._abandoned = 0  # how many of _running were given up on
        self._token_base = uuid.uuid4().hex[:16]
        self._claims = 0
        self._timed = 0  # how many of _running have a timeout to watch
        self._unwritten: list[_Outcome] = []
        self._unwritten_since: float | None = None  # when the oldest unwritten outcome arrived
        self._stopping = False
        self._closed = threading.Event()
        self._signals = 0
        self._conn: Connection | None = None
        # Poison isolation (docs/guarantees.md): the run of an `isolate` job, during which nothing else
        # is claimed, and whether a claim left such a job, so the worker drains to claim it alone.
        self._isolated: Fence | None = None
        self._isolation_wanted = False
        self.processed = 0  # outcomes written, for tests and the bench

    # -- public ------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (thread-safe)."""
        self._stopping = True
        self._wake.set()

    def run(self, *, burst: bool = False, install_signals: bool = True) -> int:
        """Process jobs until stopped (or, with ``burst``, until no job is due). Returns 0."""
        self.queue.check_schema(self.engine)
        self.sql.prepare(self.engine)
        if self.listen:
            with self.engine.connect() as conn:
                if not self.sql.has_notify_trigger(conn):
                    log.warning("worker %s: table %s has no NOTIFY trigger, so new jobs are found by polling "
                                "every %gs; add it with `sqla-jobs migrations render` or `create-tables`",
                                self.name, self.sql.jobs.fullname, self.poll_interval)
        threads = [threading.Thread(target=self._thread_main, daemon=True) for _ in range(self.concurrency)]
        for thread in threads:
            thread.start()
        if self.listen:
            threading.Thread(target=self._listen_main, daemon=True, name="sqla-jobs-listen").start()
        previous = self._install_signals() if install_signals else {}
        log.info("worker %s started: concurrency %d, lease %gs", self.name, self.concurrency, self.lease)
        try:
            self._loop(burst)
        finally:
            self._closed.set()
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            for _ in threads:
                self._todo.put(None)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        log.info("worker %s stopped after %d jobs", self.name, self.processed)
        return 0

    # -- the control loop -----------------------------------------------------------

    def _loop(self, burst: bool) -> None:
        next_heartbeat = 0.0  # reap once at start: a crashed predecessor may have left jobs
        grace_ends: float | None = None
        db_retry_at = 0.0
        db_failures = 0
        while True:
            self._wake.clear()  # before looking, so a wake-up during this turn is not lost
            self._collect()
            now = time.monotonic()
            self._check_timeouts(now)
            if self._stopping and grace_ends is None:
                grace_ends = now + self.grace
                log.info("worker %s stopping: waiting up to %gs for %d running job(s)",
                         self.name, self.grace, len(self._live()))
            if now >= db_retry_at:
                try:
                    if now >= next_heartbeat:
                        self._heartbeat_and_reap()
                        next_heartbeat = now + self.heartbeat
                    self._maybe_prune(now)
                    claimed = self._exchange(self._should_write(now), self._should_claim())
                    if db_failures:
                        log.warning("worker %s: database is back", self.name)
                    db_failures = 0
                except (OperationalError, DBAPIError, PoolTimeout) as exc:  # PoolTimeout: handlers hold the pool
                    db_failures += 1
                    pause = retry_pause(self.sql, self.engine, exc, db_failures)
                    db_retry_at = time.monotonic() + pause
                    if db_failures <= 5 or db_failures % 60 == 0:  # a long outage: not one line per second
                        log.warning("worker %s: database error, retrying in %.1fs: %s",
                                    self.name, pause, str(exc).splitlines()[0])
                    claimed = 0
                else:
                    if claimed and len(self._running) < self.concurrency:
                        continue  # the table may hold more: claim again without sleeping
            if self._stopping:
                if not self._live_count and not self._unwritten:
                    return
                if grace_ends is not None and time.monotonic() >= grace_ends:
                    self._give_back()
                    return
            elif burst and not self._live_count and not self._unwritten and self._done.empty() and db_failures == 0:
                return
            timeout = min(self.poll_interval, max(0.0, next_heartbeat - time.monotonic()))
            if self._unwritten_since is not None:
                timeout = min(timeout, self._unwritten_since + self.flush_interval - time.monotonic())
            if db_failures:  # a retry that is due now (the database answers) must not wait for a poll
                timeout = min(timeout, db_retry_at - time.monotonic())
            self._wake.wait(max(timeout, 0.001))

    @contextmanager
    def _hot(self) -> Iterator[Connection]:
        """The connection for single-statement writes (claim, finish, heartbeat, release).

        On PostgreSQL the control thread keeps one connection in autocommit
        mode: each of these writes is one fenced statement, atomic on its own,
        so a BEGIN and a COMMIT round trip per write would buy nothing. Writes
        of several statements (dead-lettering, the reaper) use ``Driver.write``.
        """
        if not self.sql.hot_connection_autocommit:
            with self.sql.write(self.engine) as conn:
                yield conn
            return
        if self._conn is None:
            self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            yield self._conn
        except DBAPIError:
            conn, self._conn = self._conn, None
            try:
                conn.invalidate()
                conn.close()
            except Exception:
                pass
            raise

    def _should_write(self, now: float) -> bool:
        """Batch completions: write when nothing else is running, the batch is full, or it waited long enough."""
        if self._unwritten_since is None:
            return False
        return (
            self._stopping
            or len(self._unwritten) >= self.batch_size
            or now - self._unwritten_since >= self.flush_interval
            or not self._live_count  # every running job is done
        )

    def _should_claim(self) -> bool:
        """Claim in batches: when at least half the threads are free, or all are idle.

        Nothing while an isolated job runs; nothing but an isolated job once one
        is waiting, so the worker drains and then claims it alone.
        """
        if self._stopping:
            return False
        if self._isolated is not None:
            if self._isolated in self._running and not self._running[self._isolated].abandoned:
                return False
            self._isolated = None
        if self._isolation_wanted and self._live_count:
            return False
        free = self.concurrency - len(self._running)
        return free > 0 and (free * 2 >= self.concurrency or not self._live_count)

    def _live(self) -> list[_Run]:
        return [run for run in self._running.values() if not run.abandoned]

    def _exchange(self, write: bool, claim: bool) -> int:
        """Write outcomes (if ``write``) and claim jobs for free threads (if ``claim``).

        Failures, snoozes and cancels are written first, one statement each
        (the rare case), so a retry that is due at once can be claimed in this
        same turn. Successes and the claim then share one round trip.
        Returns how many jobs were claimed.
        """
        ok: list[_Outcome] = []
        if write:
            for outcome in self._unwritten:
                if outcome.written:
                    continue
                if outcome.result == "ok":
                    ok.append(outcome)
                else:
                    self._write_one(outcome)
                    outcome.written = True
        limit = min(self.concurrency - len(self._running), self.batch_size) if claim else 0
        jobs: list[Claimed] = []
        if ok or limit > 0:
            self._claims += 1
            token = f"{self._token_base}{self._claims:x}"  # unique per claim; hex, so no ':' or ','
            # Alone: no live run shares the process, so an isolated job may be claimed (and only it).
            # Abandoned runs are already written off: a crash now costs them nothing.
            alone = limit > 0 and not self._live_count
            with self._hot() as conn:
                kept, jobs, waiting = self.sql.finish_and_claim(
                    conn, [o.job.fence for o in ok], max(limit, 0), self.name, token, self.lease, self.queues,
                    alone=alone,
                )
            if limit > 0:
                self._isolation_wanted = waiting
            for o in ok:
                o.written = True
                self._report(o, "finished" if o.job.id in kept else "lost")
        if write:
            self._unwritten = []
            self._unwritten_since = None
        now = time.monotonic()
        for job in jobs:
            handler = self.queue.handlers.get(job.kind)
            timeout = handler.timeout if handler else None
            ctx = JobContext(job.id, job.kind, job.queue, job.attempt, job.max_attempts, job.payload, self.name)
            self._running[job.fence] = _Run(job, ctx, now, now + timeout if timeout else None)
            if job.isolated:
                self._isolated = job.fence
                log.info("job %d %s attempt %d/%d: its worker was lost last time, so it runs alone in this process",
                         job.id, job.kind, job.attempt, job.max_attempts)
            if timeout:
                self._timed += 1
            self._todo.put(job)
        return len(jobs)

    def _collect(self) -> None:
        """Take the outcomes the threads produced; free their slots."""
        while True:
            try:
                run, outcome = self._done.get_nowait()
            except stdlib_queue.Empty:
                return
            self._running.pop(run.job.fence, None)
            if run.deadline is not None:
                self._timed -= 1
            if run.abandoned:
                self._abandoned -= 1
                log.warning("job %d %s: handler returned after its run was abandoned; result (%s) discarded",
                            run.job.id, run.job.kind, outcome.result)
                continue
            self._add_unwritten(outcome)

    def _add_unwritten(self, outcome: _Outcome) -> None:
        if self._unwritten_since is None:
            self._unwritten_since = time.monotonic()
        self._unwritten.append(outcome)

    @property
    def _live_count(self) -> int:
        """Runs whose result still counts (checked several times per job, so not a list)."""
        return len(self._running) - self._abandoned

    def _abandon(self, run: _Run) -> bool:
        """Give up on a run: its thread may go on, but its result will be discarded.

        Returns False, and changes nothing, when the run's transaction already
        holds its fenced finish and is committing: the job is then finished by
        that commit (or, if the commit fails, its error is written as usual), so
        discarding the result would misreport a job that did finish.
        """
        with self._fate:
            if run.finishing:
                return False
            if not run.abandoned:
                run.abandoned = True
                self._abandoned += 1
                run.ctx.cancelled.set()
            return True

    def _check_timeouts(self, now: float) -> None:
        if not self._timed:
            return
        for run in self._live():
            if run.deadline is not None and now > run.deadline and self._abandon(run):
                timeout = run.deadline - run.started
                self._add_unwritten(_Outcome(run.job, "error", now - run.started,
                                                f"TimeoutError: handler ran past its {timeout:g}s timeout"))

    def _write_one(self, o: _Outcome) -> None:
        job = o.job
        if o.result == "committed":
            self._report(o, "finished")
            return
        if o.result == "lost":
            self._report(o, "lost")
            return
        # The rare outcomes, in one transaction each: whether a cancel was
        # requested while the job ran decides what the write is.
        with self.sql.write(self.engine) as conn:
            if o.result in ("snooze", "error", "outage") and self.sql.cancel_requested(conn, job.fence):
                # `jobs cancel` came while it ran: no retry, no dead letter.
                applied = self.sql.release(conn, job.fence, error=o.error or None, attempt=job.attempt, cancel=True)
                name = "cancelled"
            elif o.result == "snooze":
                applied = self.sql.release(conn, job.fence, delay=o.delay, refund=True)
                name = "snoozed"
            elif o.result == "outage" and self._outages(conn, job.fence) < MAX_UNCOUNTED_OUTAGES:
                # Not the job's fault: refund the attempt, keep the error for the record.
                applied = self.sql.release(conn, job.fence, error=f"{o.error} {_UNCOUNTED}",
                                           attempt=job.attempt, refund=True)
                name = "outage"
            elif o.result == "cancel":
                applied = self.sql.release(conn, job.fence, error=o.error, attempt=job.attempt, cancel=True)
                name = "cancelled"
            elif job.attempt >= job.max_attempts:
                applied = self.sql.dead_letter(conn, job.fence, o.error)
                name = "dead_letter"
            else:
                o.delay = self.queue.retry_delay(job.kind, job.attempt)
                applied = self.sql.release(conn, job.fence, delay=o.delay, error=o.error, attempt=job.attempt)
                name = "failed"
            if not applied and o.committing and self.sql.finished_under(conn, job.fence):
                applied, name = True, "finished"  # the commit went through; only its reply was lost
        self._report(o, name if applied else "lost")

    def _outages(self, conn: Connection, fence: Fence) -> int:
        """How many attempts of this job were already refunded for outages (a rare path: one read)."""
        return sum(_UNCOUNTED in str(e.get("error", "")) for e in self.sql.errors_of(conn, fence))

    def _report(self, o: _Outcome, name: str) -> None:
        job = o.job
        self.processed += 1
        level = logging.WARNING if name in ("dead_letter", "lost") else logging.INFO
        if log.isEnabledFor(level):  # this runs per job: format only what is printed
            log.log(level, "job %d %s attempt %d/%d (%.1f ms): %s", job.id, job.kind, job.attempt,
                    job.max_attempts, o.duration * 1000, _DETAIL[name].format(o=o))
        event = _EVENT[name]
        if self.queue.listens(event):
            self.queue.emit(JobEvent(event, job.id, job.kind, job.queue, job.attempt, job.max_attempts,
                                     o.duration, o.error or None))

    def _heartbeat_and_reap(self) -> None:
        held = [run.job.fence for run in self._live()]
        held += [o.job.fence for o in self._unwritten if o.result not in ("committed", "lost")]  # no longer ours
        if held:
            with self._hot() as conn:
                kept = self.sql.heartbeat(conn, held, self.lease)
            for fence in set(held) - kept:
                run = self._running.get(fence)
                # Not abandoned when it is committing: then it is gone because we just finished it.
                if run is not None and not run.abandoned and self._abandon(run):
                    log.warning("job %d %s: lease lost while running; its result will be discarded",
                                run.job.id, run.job.kind)
        self._reap()

    def _reap(self) -> None:
        """Hand back jobs whose worker vanished, by the rules of sqla_jobs._lost (the lost attempt counts,
        and the job's next run is alone in its worker process)."""
        hand_back(self.queue, self.engine, self.sql, self.sql.expired,
                  "worker {row.locked_by} stopped heartbeating (lease expired)")

    def _maybe_prune(self, now: float) -> None:
        """With ``prune_after``: delete one batch of old finished jobs per turn, at most once a minute
        unless the last batch was full. One worker at a time (advisory lock on PostgreSQL,
        the write lock on SQLite); a batch is small, so heartbeats are never held up for long."""
        if self.prune_after is None or now < self._next_prune:
            return
        batch = 1000
        deleted = self.queue.prune(self.engine, older_than=self.prune_after, batch_size=batch, max_batches=1)
        if deleted:
            log.info("worker %s: pruned %d finished job(s) older than %gs", self.name, deleted, self.prune_after)
        self._next_prune = now + (1.0 if deleted >= batch else 60.0)

    def _give_back(self) -> None:
        """Grace is over: return unfinished jobs to the queue so they run again promptly.

        The give-back is fenced, so it cannot undo a transactional run that
        finished meanwhile (on SQLite it waits for that run's write lock, and
        the run finishes); such a run is not abandoned but waited for briefly,
        so its completion is reported like any other.
        """
        live = self._live()
        try:
            self._exchange(write=True, claim=False)
            if live:
                with self._hot() as conn:
                    given = self.sql.give_back(conn, [run.job.fence for run in live])
                log.warning("worker %s: grace period over, gave %d running job(s) back to the queue",
                            self.name, given)
        except (OperationalError, DBAPIError, PoolTimeout) as exc:
            log.warning("worker %s: could not give jobs back (%s); their leases will expire",
                        self.name, str(exc).splitlines()[0])
        committing = [run for run in live if not self._abandon(run)]
        deadline = time.monotonic() + 5.0  # a commit in flight, not a handler: seconds at most
        while any(run.job.fence in self._running for run in committing) and time.monotonic() < deadline:
            time.sleep(0.01)
            self._collect()
        if self._unwritten:
            try:
                self._exchange(write=True, claim=False)
            except (OperationalError, DBAPIError, PoolTimeout) as exc:
                log.warning("worker %s: could not record %d outcome(s) (%s); their leases will expire",
                            self.name, len(self._unwritten), str(exc).splitlines()[0])

    # -- handler threads ------------------------------------------------------------

    def _thread_main(self) -> None:
        loop: asyncio.AbstractEventLoop | None = None
        while True:
            job = self._todo.get()
            if job is None:
                if loop is not None:
                    loop.close()
                return
            run = self._running.get(job.fence)
            if run is None:
                continue
            if run.abandoned:  # given back (shutdown) before it started: it must not start now
                outcome = _Outcome(job, "lost", 0.0)
            else:
                handler = self.queue.handlers.get(job.kind)
                if handler is not None and handler.is_async and loop is None:
                    loop = asyncio.new_event_loop()
                outcome = self._execute(run, loop)
            self._done.put((run, outcome))
            # Wake the control loop when there is something to do, not after every job: the
            # first outcome starts its flush timer (flush_interval), and a failure, half the
            # threads done (enough to claim a batch) or all of them done calls for a turn now.
            waiting = self._done.qsize()
            if (waiting == 1 or outcome.result != "ok" or waiting * 2 >= self.concurrency
                    or waiting >= self._live_count):
                self._wake.set()

    def _execute(self, run: _Run, loop: asyncio.AbstractEventLoop | None) -> _Outcome:
        job, ctx = run.job, run.ctx
        handler = self.queue.handlers.get(job.kind)
        started = time.monotonic()

        def outcome(result: str, error: str = "", delay: float = 0.0) -> _Outcome:
            return _Outcome(job, result, time.monotonic() - started, error, delay)

        if handler is None:
            return outcome("error", f"UnknownKind: {self.queue.unknown_kind_message(job.kind)}")
        if self.queue.listens("started"):
            self.queue.emit(JobEvent("started", job.id, job.kind, job.queue, job.attempt, job.max_attempts))
        token = _current.set(ctx)
        dropped: set[Any]
        try:
            with watch() as dropped:
                if handler.transactional:
                    self._execute_in_transaction(run, handler.fn)
                    return outcome("committed")
                if handler.is_async:
                    assert loop is not None
                    loop.run_until_complete(asyncio.wait_for(handler.fn(job.payload), handler.timeout))
                else:
                    handler.fn(job.payload)
                return outcome("ok")
        except JobSnooze as snooze:
            return outcome("snooze", delay=snooze.seconds)
        except JobCancel as cancel:
            return outcome("cancel", f"JobCancel: {cancel.reason}")
        except _ClaimLost:
            return outcome("lost")
        except asyncio.TimeoutError:
            return outcome("error", f"TimeoutError: handler ran past its {handler.timeout:g}s timeout")
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                log.warning("job %d %s: handler raised %s; treated as a failure", job.id, job.kind, type(exc).__name__)
            # A connection to the queue database dropped or could not be opened during this
            # attempt (see outage.py): the failure is the outage's, not the job's.
            failed = outcome("outage" if self._database in dropped else "error", f"{type(exc).__name__}: {exc}")
            failed.committing = run.finishing
            return failed
        finally:
            _current.reset(token)

    def _execute_in_transaction(self, run: _Run, fn: Any) -> None:
        """The handler's writes and the job's completion commit together, or not at all."""
        with Session(self.engine) as session:
            self.sql.begin_write(session.connection())
            run.ctx.session = session
            try:
                fn(run.job.payload)
                session.flush()
                if run.abandoned or not self.sql.finish(session.connection(), [run.job.fence]):
                    raise _ClaimLost()
                with self._fate:  # from here the job is finished iff this commit succeeds
                    if run.abandoned:
                        raise _ClaimLost()
                    run.finishing = True
            except BaseException:
                session.rollback()
                raise
            finally:
                run.ctx.session = None
            session.commit()

    # -- LISTEN / NOTIFY -------------------------------------------------------------

    def _listen_main(self) -> None:
        """Wake the control loop when an enqueuing transaction commits; reconnect on errors.

        The first reconnect is immediate (a checkout never hands out a
        connection the server closed, see connection.py), later ones at most half
        a second apart, so LISTEN is back within half a second of the server.
        """
        failures = 0
        while not self._closed.is_set():
            conn = None
            try:
                raw = self.engine.raw_connection()
                conn = raw.driver_connection  # before detach(): after it the pool entry no longer knows it
                raw.detach()  # a long-lived LISTEN connection does not belong in the pool
                conn.autocommit = True  # type: ignore[union-attr]
                conn.execute(f'LISTEN "{self.sql.channel}"')  # type: ignore[union-attr]
                if failures:
                    log.info("worker %s: LISTEN connection is back", self.name)
                failures = 0
                self._wake.set()  # notifications sent while we were away are lost: look now
                while not self._closed.is_set():
                    for _ in conn.notifies(timeout=1.0):  # type: ignore[union-attr]
                        self._wake.set()
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 60 == 0:  # a long outage: not one line per second
                    log.info("worker %s: LISTEN connection failed (%s); polling until it is back",
                             self.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                if failures > 1:
                    self._closed.wait(min(0.5, 0.125 * 2 ** min(failures - 2, 2)))
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()

    # -- signals ----------------------------------------------------------------------

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("worker %s: second signal, exiting now; leases cover the running jobs", self.name)
            os._exit(1)
        log.info("worker %s: %s received, shutting down gracefully (signal again to exit at once)",
                 self.name, signal.Signals(signum).name)
        self.stop()
