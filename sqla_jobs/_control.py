"""The worker's control loop: decisions only.

Each turn it asks, in order: has a run passed its timeout? Is a heartbeat due
(which also renews the maintenance lease and, on the elected worker, reaps jobs
whose worker vanished)? Is pruning due (on the elected worker)? Should the
batch of outcomes be written now? Should it claim? Then: is it done, or how
long may it sleep? The database work is ``Store``'s, the threads are
``Executor``'s; this module only decides when to ask them.

Rules it keeps (module docstring of ``sqla_jobs._worker`` for the whole story):

* successes wait up to ``flush_interval`` to be written in one batch, unless
  nothing else is running, the batch is full or the worker is stopping;
* a claim waits until half the threads are free, unless the worker is idle;
* a job whose last worker was lost runs alone: nothing else is claimed while
  it runs, and once one is waiting the worker drains to claim it alone;
* after a database error, the next try waits ``Store.retry_pause``; outcomes
  not yet written stay in memory meanwhile;
* stopping: no more claims; running jobs get ``grace`` seconds, then are given back.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ._executor import Executor, Outcome
from ._maintenance import Maintenance
from ._store import Store
from ._worker_config import WorkerConfig
from .drivers.base import Fence

__all__ = ["Control"]

log = logging.getLogger("sqla_jobs.worker")

#: What a failed database step raises (PoolTimeout: handlers hold the whole pool).
DATABASE_ERRORS = (OperationalError, DBAPIError, PoolTimeout)
PRUNE_BATCH = 1000


class Control:
    def __init__(self, config: WorkerConfig, store: Store, executor: Executor, wake: threading.Event,
                 maintenance: Maintenance | None = None) -> None:
        self.config = config
        self.maintenance = maintenance or Maintenance(None)
        self.store = store
        self.executor = executor
        self.wake = wake
        self.name = config.worker_name
        self.stopping = False
        self._unwritten: list[Outcome] = []
        self._unwritten_since: float | None = None  # when the oldest unwritten outcome arrived
        self._token_base = uuid.uuid4().hex[:16]
        self._claims = 0
        # Poison isolation (docs/guarantees.md): the run of an `isolate` job, during which nothing else
        # is claimed, and whether a claim left such a job, so the worker drains to claim it alone.
        self._isolated: Fence | None = None
        self._isolation_wanted = False
        self._next_prune = 0.0

    def run(self, burst: bool) -> None:
        """Turn until stopped (or, with ``burst``, until nothing is due and nothing is left to write)."""
        ex = self.executor
        next_heartbeat = 0.0  # reap once at start: a crashed predecessor may have left jobs
        grace_ends: float | None = None
        db_retry_at = 0.0
        db_failures = 0
        while True:
            self.wake.clear()  # before looking, so a wake-up during this turn is not lost
            ex.collect(self._add_unwritten)
            now = time.monotonic()
            for failed in ex.timed_out(now):
                self._add_unwritten(failed)
            if self.stopping and grace_ends is None:
                grace_ends = now + self.config.grace
                log.info("worker %s stopping: waiting up to %gs for %d running job(s)",
                         self.name, self.config.grace, ex.live_count)
            if now >= db_retry_at:
                try:
                    if now >= next_heartbeat:
                        self._heartbeat_and_reap()
                        next_heartbeat = now + self.config.heartbeat_every
                    if self._should_prune(now):
                        deleted = self.store.prune(self.config.prune_after or 0.0, PRUNE_BATCH)
                        self._next_prune = now + (1.0 if deleted >= PRUNE_BATCH else 60.0)
                    claimed = self._exchange(self._should_write(now), self._should_claim())
                    if db_failures:
                        log.warning("worker %s: database is back", self.name)
                    db_failures = 0
                except DATABASE_ERRORS as exc:
                    db_failures += 1
                    pause = self.store.retry_pause(exc, db_failures)
                    db_retry_at = time.monotonic() + pause
                    if db_failures <= 5 or db_failures % 60 == 0:  # a long outage: not one line per second
                        log.warning("worker %s: database error, retrying in %.1fs: %s",
                                    self.name, pause, str(exc).splitlines()[0])
                    claimed = 0
                else:
                    if claimed and len(ex.running) < self.config.concurrency:
                        continue  # the table may hold more: claim again without sleeping
            if self.stopping:
                if not ex.live_count and not self._unwritten:
                    return
                if grace_ends is not None and time.monotonic() >= grace_ends:
                    self._give_back()
                    return
            elif burst and not ex.live_count and not self._unwritten and not ex.has_outcomes() and db_failures == 0:
                return
            timeout = min(self.config.poll_interval, max(0.0, next_heartbeat - time.monotonic()))
            if self._unwritten_since is not None:
                timeout = min(timeout, self._unwritten_since + self.config.flush_interval - time.monotonic())
            if db_failures:  # a retry that is due now (the database answers) must not wait for a poll
                timeout = min(timeout, db_retry_at - time.monotonic())
            self.wake.wait(max(timeout, 0.001))

    # -- decisions -----------------------------------------------------------------------

    def _should_write(self, now: float) -> bool:
        """Batch completions: write when nothing else is running, the batch is full, or it waited long enough."""
        if self._unwritten_since is None:
            return False
        return (
            self.stopping
            or len(self._unwritten) >= self.config.batch_size
            or now - self._unwritten_since >= self.config.flush_interval
            or not self.executor.live_count  # every running job is done
        )

    def _should_claim(self) -> bool:
        """Claim in batches: when at least half the threads are free, or all are idle.

        Nothing while an isolated job runs; nothing but an isolated job once one
        is waiting, so the worker drains and then claims it alone.
        """
        if self.stopping:
            return False
        running = self.executor.running
        if self._isolated is not None:
            if self._isolated in running and not running[self._isolated].abandoned:
                return False
            self._isolated = None
        if self._isolation_wanted and self.executor.live_count:
            return False
        free = self.config.concurrency - len(running)
        return free > 0 and (free * 2 >= self.config.concurrency or not self.executor.live_count)

    def _should_prune(self, now: float) -> bool:
        """With ``prune_after``: one batch per turn, at most once a minute unless the last batch was full."""
        return self.config.prune_after is not None and now >= self._next_prune and self.maintenance.acting

    # -- steps -----------------------------------------------------------------------------

    def _add_unwritten(self, outcome: Outcome) -> None:
        if self._unwritten_since is None:
            self._unwritten_since = time.monotonic()
        self._unwritten.append(outcome)

    def _exchange(self, write: bool, claim: bool) -> int:
        """Write outcomes (if ``write``) and claim jobs for free threads (if ``claim``); how many were claimed.

        Failures, snoozes and cancels are written first, one each (the rare
        case), so a retry that is due at once can be claimed in this same turn.
        Successes and the claim then share one round trip.
        """
        ex = self.executor
        ok: list[Outcome] = []
        if write:
            for outcome in self._unwritten:
                if outcome.written:
                    continue
                if outcome.result == "ok":
                    ok.append(outcome)
                else:
                    self.store.write_one(outcome)
                    outcome.written = True
        limit = min(self.config.concurrency - len(ex.running), self.config.batch_size) if claim else 0
        jobs = []
        if ok or limit > 0:
            self._claims += 1
            token = f"{self._token_base}{self._claims:x}"  # unique per claim; hex, so no ':' or ','
            # Alone: no live run shares the process, so an isolated job may be claimed (and only it).
            # Abandoned runs are already written off: a crash now costs them nothing.
            jobs, waiting = self.store.finish_and_claim(ok, max(limit, 0), token, alone=limit > 0 and not ex.live_count)
            if limit > 0:
                self._isolation_wanted = waiting
        if write:
            self._unwritten = []
            self._unwritten_since = None
        now = time.monotonic()
        for job in jobs:
            ex.submit(job, now)
            if job.isolated:
                self._isolated = job.fence
                log.info("job %d %s attempt %d/%d: its worker was lost last time, so it runs alone in this process",
                         job.id, job.kind, job.attempt, job.max_attempts)
        return len(jobs)

    def _heartbeat_and_reap(self) -> None:
        ex = self.executor
        held = [run.job.fence for run in ex.live()]
        held += [o.job.fence for o in self._unwritten if o.result not in ("committed", "lost")]  # no longer ours
        if held:
            kept = self.store.heartbeat(held)
            for fence in set(held) - kept:
                run = ex.running.get(fence)
                # Not abandoned when it is committing: then it is gone because we just finished it.
                if run is not None and not run.abandoned and ex.abandon(run):
                    log.warning("job %d %s: lease lost while running; its result will be discarded",
                                run.job.id, run.job.kind)
        if self.maintenance.renew():  # the elected worker reaps for all (sqla_jobs.leader)
            self.store.reap()

    def _give_back(self) -> None:
        """Grace is over: return unfinished jobs to the queue so they run again promptly.

        The give-back is fenced, so it cannot undo a transactional run that
        finished meanwhile (on SQLite it waits for that run's write lock, and
        the run finishes); such a run is not abandoned but waited for briefly,
        so its completion is reported like any other.
        """
        ex = self.executor
        live = ex.live()
        try:
            self._exchange(write=True, claim=False)
            if live:
                given = self.store.give_back([run.job.fence for run in live])
                log.warning("worker %s: grace period over, gave %d running job(s) back to the queue",
                            self.name, given)
        except DATABASE_ERRORS as exc:
            log.warning("worker %s: could not give jobs back (%s); their leases will expire",
                        self.name, str(exc).splitlines()[0])
        committing = [run for run in live if not ex.abandon(run)]
        deadline = time.monotonic() + 5.0  # a commit in flight, not a handler: seconds at most
        while any(run.job.fence in ex.running for run in committing) and time.monotonic() < deadline:
            time.sleep(0.01)
            ex.collect(self._add_unwritten)
        if self._unwritten:
            try:
                self._exchange(write=True, claim=False)
            except DATABASE_ERRORS as exc:
                log.warning("worker %s: could not record %d outcome(s) (%s); their leases will expire",
                            self.name, len(self._unwritten), str(exc).splitlines()[0])
