"""The worker's control loop: decisions only.

Each turn it asks, in order: has a run passed its timeout? Is a heartbeat due
(which also renews the maintenance lease and, on the elected worker, reaps jobs
whose worker vanished)? Is pruning due (on the elected worker)? Should the
batch of outcomes be written now? Should it claim? Then: is it done, or how
long may it sleep? The database work is ``Store``'s, the threads are
``Executor``'s; this module only decides when to ask them.

Rules it keeps (module docstring of ``sqla_jobs.worker.worker`` for the whole story):

* successes wait up to ``flush_interval`` to be written in one batch, unless
  nothing else is running, the batch is full or the worker is stopping;
* a claim waits until half the threads are free, unless the worker is idle;
  with per-queue slots the rule holds per queue (half its slots free, or none
  of its jobs running), each queue is claimed in its own batch for its free
  slots only, and a queue found empty is asked again after ``poll_interval``
  or a wake-up from the database (LISTEN), not on every turn;
* every heartbeat also asks which running jobs someone asked to cancel and
  tells their handlers (``Executor.deliver_cancel``); where the database
  notifies (PostgreSQL: ``queue.cancel`` sends a NOTIFY), a notification also
  triggers that question, at most every ``CANCEL_CHECK_EVERY`` seconds;
* progress values handlers set are written at most once a second;
* a job whose last worker was lost runs alone: nothing else is claimed while
  it runs, and once one is waiting the worker drains to claim it alone;
* after a database error, the next try waits ``Store.retry_pause``; outcomes not yet written stay in
  memory meanwhile; back, it renews its leases first, hands back the jobs a claim cut short left it
  (``Store.hand_back_strays``), and does not reap for one lease (nobody could renew meanwhile); nor
  after any write of its own that waited a third of a lease (``Store.waited``: so did everyone's);
* stopping: no more claims; running jobs get ``grace`` seconds, then are handed back;
* a run whose lease went unrenewed for 2/3 of it is stopped (``LeaseGuard``); nothing is claimed
  until a heartbeat succeeds, and then the stopped jobs are handed back;
* nothing is claimed while the executor is not ``accepting`` (the relay's
  ``PublishExecutor`` while its broker is unreachable: the jobs wait pending).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from ..drivers.base import Claimed, Fence
from .config import WorkerConfig
from .executor import Executor, Outcome
from .fencing import LeaseGuard
from .maintenance import Maintenance
from .store import Store

__all__ = ["Control"]

log = logging.getLogger("sqla_jobs.worker")

#: What a failed database step raises (PoolTimeout: handlers hold the whole pool).
DATABASE_ERRORS = (OperationalError, DBAPIError, PoolTimeout)
PRUNE_BATCH = 1000
#: Seconds between two rounds of the table's upkeep on the leader (partitioned PostgreSQL: the coming days).
UPKEEP_EVERY = 600.0
#: Seconds between writes of the progress values handlers set (each write is one statement per job).
PROGRESS_EVERY = 1.0
#: Least seconds between cancel checks prompted by notifications (a busy enqueuer notifies often).
CANCEL_CHECK_EVERY = 0.5

READ_ONLY_LINE = ("worker %s: the database takes no writes (a standby, or switched to read-only): nothing is claimed"
                  " or written, and no attempt is charged, until a writable server answers; trying every %.0fs. %s")
#: One claim to make this turn: the queues it takes from (None: the worker's) and how many jobs at most.
Claim = tuple[Sequence[str] | None, int]


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
        # How the loop sleeps outside ``wake.wait`` (the async worker's runs on the event loop: it awaits).
        self.pause: Callable[[float], None] = time.sleep
        self._unwritten: list[Outcome] = []
        self._unwritten_since: float | None = None  # when the oldest unwritten outcome arrived
        self._token_base = uuid.uuid4().hex[:16]
        self._claims = 0
        # Poison isolation (docs/guarantees.md): the run of an `isolate` job, during which nothing else
        # is claimed, and whether a claim left such a job, so the worker drains to claim it alone.
        self._isolated: Fence | None = None
        self._isolation_wanted = False
        self._next_prune = self._next_upkeep = self._next_progress = 0.0
        self.guard = LeaseGuard(executor, config.lease, config.worker_name, store.driver.self_fencing)
        # Per-queue slots: when each queue found empty may be asked again (monotonic time).
        self._empty_until: dict[str, float] = {}
        self.notified = False  # set by the database listener: new jobs, so every queue is worth asking
        # With limits: when the ordinary claim (kinds without limits) last found nothing more, it is not
        # made again until a poll interval passes, the database announces new jobs or a retry is written.
        # It skips the limited kinds' pending jobs one by one, so with a backlog of those each try walks
        # the whole backlog: repeated on every claim, that walk was most of a limited drain's time.
        self._others_idle_until = 0.0
        self._burst = self._wrote = False  # _wrote: the last exchange wrote outcomes
        # Also set by the listener: a cancel request may have come (PostgreSQL's cancel notifies).
        self.cancel_check = False
        self._next_cancel_check = 0.0

    def wake_from_database(self) -> None:
        """The listener's callback: jobs were enqueued (or made due), so empty queues are asked again."""
        self.notified = True
        self.cancel_check = True
        self._others_idle_until = 0.0
        self.wake.set()

    def run(self, burst: bool) -> None:
        """Turn until stopped (or, with ``burst``, until nothing is due and nothing is left to write)."""
        with self.guard:  # its own thread: this one may hang in a read during a network partition
            self._turn_until_done(burst)

    def _turn_until_done(self, burst: bool) -> None:
        ex = self.executor
        self._burst = burst
        next_heartbeat = 0.0  # reap once at start: a crashed predecessor may have left jobs
        grace_ends: float | None = None
        db_retry_at = 0.0
        db_failures = 0
        read_only = False  # the last database error said the server takes no writes
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
                    if db_failures:  # back: renew ours first; nobody could meanwhile, so no reaping for a lease
                        self.store.hold_reaper()
                    if now >= next_heartbeat or db_failures:
                        self._heartbeat_and_reap(now, after_outage=db_failures > 0)
                        next_heartbeat = now + self.config.heartbeat_every
                    if self._should_prune(now):
                        deleted = self.store.prune(self.config.prune_after or 0.0, PRUNE_BATCH)
                        self._next_prune = now + (1.0 if deleted >= PRUNE_BATCH else 60.0)
                    if self.cancel_check and now >= self._next_cancel_check:
                        self._check_cancels(now)
                    if ex.progress and now >= self._next_progress:
                        self._next_progress = now + PROGRESS_EVERY
                        self.store.write_progress(ex.take_progress())
                    claimed = self._exchange(self._should_write(now), self._claims_due(now))
                    if db_failures:
                        log.warning("worker %s: database is back%s", self.name, " and writable" if read_only else "")
                    db_failures = 0
                    read_only = False
                except DATABASE_ERRORS as exc:
                    db_failures += 1
                    pause = self.store.retry_pause(exc, db_failures)
                    db_retry_at = time.monotonic() + pause
                    if self.store.driver.is_read_only(exc):
                        if not read_only:  # one line: it may last a while, and every try fails the same way
                            log.warning(READ_ONLY_LINE, self.name, pause, str(exc).splitlines()[0])
                        read_only = True
                    elif db_failures <= 5 or db_failures % 60 == 0:  # a long outage: not one line per second
                        log.warning("worker %s: database error, retrying in %.1fs: %s",
                                    self.name, pause, str(exc).splitlines()[0])
                    claimed = 0
                else:
                    # More may be due (a full claim; a burst's writes may have unblocked dependents): no sleep.
                    if (claimed and len(ex.running) < self.config.concurrency) or (burst and self._wrote):
                        continue
            if self.stopping:
                if not ex.live_count and not self._unwritten:
                    return
                if grace_ends is not None and time.monotonic() >= grace_ends:
                    self._hand_back_unfinished()
                    return
            elif (burst and ex.accepting and not ex.live_count and not self._unwritten and not ex.has_outcomes()
                  and db_failures == 0):
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
            or len(self._unwritten) >= self.config.claim_limit
            or now - self._unwritten_since >= self.config.flush_interval
            or not self.executor.live_count  # every running job is done
        )

    def _should_claim(self) -> bool:
        """Claim in batches: when at least half the threads are free, or all are idle (with per-queue slots,
        the same per queue, in ``_claims_due``). Nothing while an isolated job runs; nothing but an isolated
        job once one is waiting, so the worker drains and then claims it alone."""
        if self.stopping or not self.executor.accepting:  # the relay's broker is unreachable: jobs wait pending
            return False
        if self.guard.active:  # runs were stopped for want of a lease renewal: none until one succeeds
            return False
        running = self.executor.running
        if self._isolated is not None:
            if self._isolated in running and not running[self._isolated].abandoned:
                return False
            self._isolated = None
        if self._isolation_wanted and self.executor.live_count:
            return False
        if self.config.queue_slots is not None:
            return True  # the half-free rule is per queue then: see _claims_due
        free = self.config.concurrency - len(running)
        return free > 0 and (free * 2 >= self.config.concurrency or not self.executor.live_count)

    def _claims_due(self, now: float) -> list[Claim]:
        """The claims to make this turn: one for all the worker's queues, or with per-queue slots one
        per queue that has half its slots free (or nothing running) and was not just found empty."""
        if not self._should_claim():
            return []
        slots = self.config.slots
        if slots is None:
            return [(None, min(self.config.concurrency - len(self.executor.running), self.config.claim_limit))]
        if self.notified:
            self.notified = False
            self._empty_until.clear()
        running_in = self.executor.running_in
        claims: list[Claim] = []
        for name, count in slots.items():
            free = count - running_in.get(name, 0)
            if free > 0 and (free * 2 >= count or not running_in.get(name)) and now >= self._empty_until.get(name, 0.0):
                claims.append(([name], min(free, self.config.claim_limit)))
        return claims

    def _should_prune(self, now: float) -> bool:
        """With ``prune_after``: one batch per turn, at most once a minute unless the last batch was full."""
        return self.config.prune_after is not None and now >= self._next_prune and self.maintenance.acting

    # -- steps -----------------------------------------------------------------------------

    def _add_unwritten(self, outcome: Outcome) -> None:
        if self._unwritten_since is None:
            self._unwritten_since = time.monotonic()
        self._unwritten.append(outcome)

    def _exchange(self, write: bool, claims: list[Claim]) -> int:
        """Write outcomes (if ``write``) and make ``claims`` for free threads; how many jobs were claimed.

        Failures, snoozes and cancels are written first, in one transaction
        (the rare case: ``Store.settle``), so a retry that is due at once can be
        claimed in this same turn; so are successes that carry a result or
        progress. The plain successes and the first claim then share one round
        trip; each further claim (per queue, with slots) is one more.
        """
        ex = self.executor
        ok: list[Outcome] = []
        self._wrote = write and bool(self._unwritten)
        if write:
            valued: list[Outcome] = []
            rare: list[Outcome] = []
            for outcome in self._unwritten:
                if outcome.written:
                    continue
                if outcome.result == "ok":
                    (ok if outcome.value is None and outcome.progress is None else valued).append(outcome)
                else:
                    rare.append(outcome)
            if rare:
                self.store.settle(rare)
                for outcome in rare:
                    self._empty_until.pop(outcome.job.queue, None)  # a retry may be due at once
                self._others_idle_until = 0.0
            if valued:
                self.store.finish_with_results(valued)
        claimed = 0
        isolated_waiting: bool | None = None  # whether any claim this turn left a job that must run alone
        for queues, limit in claims or ([(None, 0)] if ok else []):
            self._claims += 1
            token = f"{self._token_base}{self._claims:x}"  # unique per claim; hex, so no ':' or ','
            # Alone: no live run shares the process, so an isolated job may be claimed (and only it).
            # Abandoned runs are already written off: a crash now costs them nothing.
            jobs, waiting, others_short = self.store.finish_and_claim(
                ok, limit, token, alone=limit > 0 and not ex.live_count, queues=queues,
                plain=self._burst or time.monotonic() >= self._others_idle_until,  # burst: look before leaving
            )
            ok = []  # finished by the first round trip
            if others_short:
                self._others_idle_until = time.monotonic() + self.config.poll_interval
            if limit > 0:
                isolated_waiting = bool(isolated_waiting) or waiting
                if queues is not None and len(jobs) < limit:
                    self._empty_until[queues[0]] = time.monotonic() + self.config.poll_interval
            self._start(jobs)
            claimed += len(jobs)
            if waiting or any(job.isolated for job in jobs):
                # A job that runs alone was claimed, or waits for the worker to drain: no other
                # queue's claim this turn (nor later, see _should_claim).
                break
        if isolated_waiting is not None:
            self._isolation_wanted = isolated_waiting
        if write:
            self._unwritten = []
            self._unwritten_since = None
        return claimed

    def _start(self, jobs: list[Claimed]) -> None:
        ex = self.executor
        now = time.monotonic()
        for job in jobs:
            ex.submit(job, now)
            if job.isolated:
                self._isolated = job.fence
                log.info("job %d %s attempt %d/%d: its worker was lost last time, so it runs alone in this process",
                         job.id, job.kind, job.attempt, job.max_attempts)
        if jobs:
            ex.flush()

    def _heartbeat_and_reap(self, now: float, after_outage: bool = False) -> None:
        ex, began = self.executor, time.monotonic()
        held = [run.job.fence for run in ex.live()]
        held += [o.job.fence for o in self._unwritten if o.result not in ("committed", "lost")]  # no longer ours
        held += self.guard.held()  # stopped by self-fencing, their handlers not yet returned
        if after_outage:
            self.store.hand_back_strays(held)
        sent = time.monotonic()
        if held:
            kept, cancels = self.store.heartbeat(held)
            self._deliver_cancels(cancels)
            for fence in set(held) - kept:
                run = ex.running.get(fence)
                # Not abandoned when it is committing: then it is gone because we just finished it.
                if run is not None and not run.abandoned and ex.abandon(run):
                    log.warning("job %d %s: lease lost while running; its result will be discarded",
                                run.job.id, run.job.kind)
        self.guard.renewed(sent, self.store)
        # The elected worker reaps for all (sqla_jobs.leader); not within a lease of its own return from an
        # outage (the server's own restart: Driver.expired), nor of a heartbeat or an election that waited a
        # third of a lease (Store.waited): live workers' leases may have run out meanwhile.
        acting = self.maintenance.renew()
        self.store.waited(began)  # the strays' hand-back, the heartbeat, the election
        if acting:
            self.store.reap()
            if time.monotonic() >= self._next_upkeep:
                self.store.upkeep()
                self._next_upkeep = time.monotonic() + UPKEEP_EVERY

    def _check_cancels(self, now: float) -> None:
        """A notification came: ask now (not at the next heartbeat) whether a live run was cancelled."""
        self.cancel_check = False
        live = self.executor.live()
        if live:
            self._next_cancel_check = now + CANCEL_CHECK_EVERY
            self._deliver_cancels(self.store.cancel_requests([run.job.fence for run in live]))

    def _deliver_cancels(self, fences: set[Fence]) -> None:
        ex = self.executor
        for fence in fences:
            run = ex.running.get(fence)
            if run is not None and ex.deliver_cancel(run):
                log.info("job %d %s: cancel requested; its handler was told", run.job.id, run.job.kind)

    def _hand_back_unfinished(self) -> None:
        """Grace is over: return unfinished jobs to the queue so they run again promptly.

        The hand-back (the outcome policy's ``shutdown``) is fenced, so it cannot
        undo a transactional run that finished meanwhile (on SQLite it waits for that run's write lock, and
        the run finishes); such a run is not abandoned but waited for briefly,
        so its completion is reported like any other.
        """
        ex = self.executor
        live = ex.live()
        try:
            self._exchange(write=True, claims=[])
            if live:
                given = self.store.hand_back([run.job.fence for run in live])
                log.warning("worker %s: grace period over, gave %d running job(s) back to the queue",
                            self.name, given)
        except DATABASE_ERRORS as exc:
            log.warning("worker %s: could not give jobs back (%s); their leases will expire",
                        self.name, str(exc).splitlines()[0])
        committing = [run for run in live if not ex.abandon(run)]
        deadline = time.monotonic() + 5.0  # a commit in flight, not a handler: seconds at most
        while any(run.job.fence in ex.running for run in committing) and time.monotonic() < deadline:
            self.pause(0.01)
            ex.collect(self._add_unwritten)
        if self._unwritten:
            try:
                self._exchange(write=True, claims=[])
            except DATABASE_ERRORS as exc:
                log.warning("worker %s: could not record %d outcome(s) (%s); their leases will expire",
                            self.name, len(self._unwritten), str(exc).splitlines()[0])
