"""The worker's database side: every read and write the control loop asks for, through the driver.

One ``Store`` per worker. It owns the control thread's hot connection (on
PostgreSQL one autocommit connection: each hot write is one fenced statement,
atomic on its own, so a BEGIN/COMMIT round trip would buy nothing; on
MariaDB/MySQL one connection kept at READ COMMITTED), writes
outcomes (``finish_and_claim`` for the batch of successes plus the claim in one
round trip, ``settle`` for the rare outcomes, as the outcome policy decides), heartbeats, reaps, prunes and
hands jobs back, and reports each written outcome to the log and the hooks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from .._app import JobEvent, JobQueue
from .._limits import ensure_limits_table, limits_table
from ..drivers import connect_at
from ..drivers._limits import claim_limited, ensure_rows
from ..drivers.base import Claimed, Driver, Fence
from .executor import Outcome
from .fair_turns import fair_turns
from .outcomes import hand_back_lost, hand_back_unfinished, park_delay, settle
from .reconnect import retry_pause

__all__ = ["Store"]

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
# What hooks hear of each outcome: an outage is a failed run that is retried.
_EVENT = {**{name: name for name in _DETAIL}, "outage": "failed"}


def _level(name: str) -> int:
    """The level an outcome is logged at: a run lost or dead-lettered is a warning."""
    return logging.WARNING if name in ("dead_letter", "lost") else logging.INFO


class Store:
    def __init__(self, engine: Engine, queue: JobQueue[Any, Any], driver: Driver, worker_name: str,
                 lease: float, queues: Sequence[str] | None) -> None:
        self.engine = engine
        self.queue = queue
        self.driver = driver
        self.worker_name = worker_name
        self.lease = lease
        self.queues = list(queues) if queues else None
        self._conn: Connection | None = None
        self._reap_after = 0.0  # monotonic: no reaping before (a write of ours waited; see _hot)
        self.processed = 0  # outcomes written
        #: Kinds with limits across workers (sqla_jobs._limits): claimed by claim_limited, skipped by the
        #: ordinary claim. None of them: the claim is the plain one, not one statement more.
        self.limits = queue.kind_limits()
        self.limited_kinds = [lim.kind for lim in self.limits]
        self.limits_table = limits_table(queue) if self.limits else None
        #: Fair queues this worker claims from (sqla_jobs._fair): each its own claim, turn about with the plain
        #: claim, which leaves them out; each with the last key this worker served (its cursor in the ring).
        self.fair = {name: spec for name, spec in queue.fair.items() if self.queues is None or name in self.queues}
        self.cursors = dict.fromkeys(self.fair, "")
        self.fair_turn = 0
        if self.fair:
            self.driver = driver.skipping_queues(list(self.fair))
        self._capped_only = all(lim.running is not None and lim.key is None and not lim.rate_count
                                for lim in self.limits)

    def prepare(self, listen: bool, poll_interval: float) -> None:
        """Before the first claim: the schema is the app's, the driver is ready, wake-ups can work."""
        self.queue.check_schema(self.engine)
        self.driver.prepare(self.engine)
        if self.limits_table is not None:
            ensure_limits_table(self.engine, self.limits_table)
            ensure_rows(self.driver, self.engine, self.limits_table, [lim.row for lim in self.limits])
        if listen:
            with self.engine.connect() as conn:
                if not self.driver.has_notify_trigger(conn):
                    log.warning("worker %s: table %s has no NOTIFY trigger, so new jobs are found by polling "
                                "every %gs; add it with `sqla-jobs migrations render` or `create-tables`",
                                self.worker_name, self.driver.jobs.fullname, poll_interval)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def retry_pause(self, exc: BaseException, failures: int) -> float:
        return retry_pause(self.driver, self.engine, exc, failures)

    def hold_reaper(self) -> None:
        """No reaping for a lease: the database was away, and live workers now renew what ran out meanwhile."""
        self._reap_after = max(self._reap_after, time.monotonic() + self.lease)

    def reaper_held(self) -> bool:
        """Whether ``hold_reaper`` (or ``waited``) still keeps this worker's reaper away."""
        return time.monotonic() < self._reap_after

    def waited(self, since: float) -> None:
        """A write of this worker's, begun at ``since`` (monotonic), has just returned: if it waited a third
        of a lease (SQLite's write lock held elsewhere, a stalled server, a pooler waiting for its server),
        every other worker's renewals waited too, and their leases may have run out while they lived: the
        reaper waits a lease for them to renew."""
        waited = time.monotonic() - since
        if waited > self.lease / 3:
            if time.monotonic() >= self._reap_after:
                log.info("worker %s: a write waited %.1fs for the database, so the lease reaper waits a lease "
                         "for the other workers to renew theirs", self.worker_name, waited)
            self.hold_reaper()

    @contextmanager
    def hot(self) -> Iterator[Connection]:
        """The connection for the worker's short writes (claim, finish, heartbeat, release); see ``waited``."""
        began = time.monotonic()
        try:
            with self._hot_connection() as conn:
                yield conn
        finally:
            self.waited(began)

    @contextmanager
    def _hot_connection(self) -> Iterator[Connection]:
        """The connection for the worker's short writes.

        One long-lived connection at the driver's ``hot_isolation``: on PostgreSQL in
        autocommit (each hot write is one fenced statement), on MariaDB/MySQL at READ
        COMMITTED, set once for the connection instead of once per transaction, with
        each use committed here. Where there is none (SQLite), each use is a
        ``Driver.write`` transaction. Writes of several statements (dead-lettering,
        the reaper) always use ``Driver.write``.
        """
        isolation = self.driver.hot_isolation
        if isolation is None:
            with self.driver.write(self.engine) as conn:
                yield conn
            return
        if self._conn is None:
            # SQLAlchemy puts the connection's isolation back when it returns to the pool, so the app's
            # own checkouts never see this one.
            self._conn = connect_at(self.engine, isolation)
        conn = self._conn
        try:
            yield conn
            if isolation != "AUTOCOMMIT":
                conn.commit()
        except DBAPIError:
            self._conn = None
            try:
                conn.invalidate()
                conn.close()
            except Exception:
                pass
            raise
        except BaseException:
            if isolation != "AUTOCOMMIT" and conn.in_transaction():
                conn.rollback()
            raise

    # -- the hot path ------------------------------------------------------------------

    def finish_and_claim(self, ok: list[Outcome], limit: int, token: str, alone: bool,
                         queues: Sequence[str] | None = None, plain: bool = True) -> tuple[list[Claimed], bool, bool]:
        """Mark ``ok`` finished and claim up to ``limit`` jobs, in one round trip; report the finished ones.

        ``queues``: claim from these (a per-queue claim) instead of the worker's queues.
        ``plain``: with limits, whether to make the ordinary claim (of the kinds without limits) too.
        Returns the claimed jobs, whether a job that must run alone is waiting, and whether the ordinary
        claim, made beside limits, found fewer jobs than it asked for (always False without limits).
        With fair queues among ``queues``, each has a claim of its own (``Driver.claim_fair``); they and the
        plain claim take turns at going first, so none of them starves the others of the worker's threads.
        """
        queues = queues if queues is not None else self.queues
        fair = [name for name in self.fair if queues is None or name in queues] if limit > 0 else []
        if not fair:
            return self.finish_and_claim_plain(ok, limit, token, alone, queues, plain)
        return fair_turns(self, fair, ok, limit, token, alone, queues, plain)

    def finish_and_claim_plain(self, ok: list[Outcome], limit: int, token: str, alone: bool,
                               queues: Sequence[str] | None, plain: bool) -> tuple[list[Claimed], bool, bool]:
        """``finish_and_claim`` without fair queues: the plain claim (and the limited kinds'), as always."""
        fences = [o.job.fence for o in ok]
        short = False
        if self.limits_table is None or limit <= 0:  # no limits (or no claim): the one round trip it always was
            with self.hot() as conn:
                kept, jobs, waiting = self.driver.finish_and_claim(
                    conn, fences, limit, self.worker_name, token, self.lease, queues, alone=alone,
                    skip_kinds=self.limited_kinds, upstreams=[o.job.id for o in ok if o.job.has_dependents],
                )
        elif (fast := self._capped(fences, limit, token, alone, queues, plain)) is not None:
            kept, jobs, waiting, short = fast
        else:
            # One transaction, so a claim is never half made: the finishes first (the jobs just done no longer
            # count as running), then the kinds with limits (drivers/_limits.py, under their rows' locks), then
            # the ordinary claim, skipping those kinds, for the threads still free.
            with self.driver.write(self.engine) as conn:
                kept = self.driver.finish(conn, fences)
                jobs, waiting, lone = claim_limited(self.driver, conn, self.limits_table, self.limits, limit,
                                                    self.worker_name, token, self.lease, queues, alone)
                if plain and not lone and len(jobs) < limit:
                    wanted = limit - len(jobs)
                    _, others, others_waiting = self.driver.finish_and_claim(
                        conn, [], wanted, self.worker_name, token, self.lease, queues,
                        alone=alone and not jobs, skip_kinds=self.limited_kinds,
                    )
                    short = len(others) < wanted
                    jobs, waiting = jobs + others, waiting or others_waiting
        self.report_finished(ok, kept)
        return jobs, waiting, short

    def report_finished(self, ok: list[Outcome], kept: set[int]) -> None:
        """After a finish of ``ok`` that kept ``kept``: finish those it declined, report each run."""
        kept = self.finish_declined(ok, kept)
        for o in ok:
            o.written = True
        if len(kept) == len(ok):  # kept holds ids of ok only: every run was finished
            self.report_all(ok, "finished")
            return
        for o in ok:
            self.report(o, "finished" if o.job.id in kept else "lost")

    def finish_declined(self, ok: list[Outcome], kept: set[int]) -> set[int]:
        """``kept`` plus those of ``ok`` a one-statement finish left (PostgreSQL's hot statement leaves a job
        that others depend on: see ``_PG_FINISH_AND_CLAIM``), finished now with their dependents counted down
        in one transaction. A run that was really lost is not ours here either and stays out."""
        declined = [o.job.fence for o in ok if o.job.id not in kept]
        if not declined:
            return kept
        with self.driver.write(self.engine) as conn:
            return kept | self.driver.finish(conn, declined)

    def _capped(self, fences: list[Fence], limit: int, token: str, alone: bool, queues: Sequence[str] | None,
                plain: bool) -> tuple[set[int], list[Claimed], bool, bool] | None:
        """``finish_and_claim`` the backend's faster way, when it has one and every limit is a plain running
        limit (PostgreSQL: one pipeline on the hot connection, drivers/postgresql/capped.py); None: it has not."""
        if not self._capped_only or self.driver.hot_isolation != "AUTOCOMMIT" or self.driver.skip_queues:
            return None
        assert self.limits_table is not None
        with self.hot() as conn:
            fast = self.driver.finish_and_claim_capped(conn, fences, self.limits_table, self.limits, limit,
                                                    self.worker_name, token, self.lease, queues, alone, plain)
        if fast is None:
            return None
        kept, jobs, waiting, short, missing = fast
        if missing:  # someone deleted the kind's row: made again for the next claim
            ensure_rows(self.driver, self.engine, self.limits_table, missing)
        return kept, jobs, waiting, short

    def finish_with_results(self, ok: list[Outcome]) -> None:
        """Finish runs that returned a value or left progress unwritten: store both, then finish, in one
        transaction (off the hot path: a handler returning None never comes here)."""
        with self.driver.write(self.engine) as conn:
            self.driver.set_results(conn, [(o.job.fence, o.value, o.progress) for o in ok])
            kept = self.driver.finish(conn, [o.job.fence for o in ok])
        for o in ok:
            o.written = True
            self.report(o, "finished" if o.job.id in kept else "lost")

    def heartbeat(self, fences: list[Fence]) -> tuple[set[Fence], set[Fence]]:
        """Extend the leases of ``fences``; returns those still ours, and those of them someone asked to cancel."""
        with self.hot() as conn:
            kept = self.driver.heartbeat(conn, fences, self.lease)
            return kept, self.driver.cancel_requests(conn, list(kept)) if kept else set()

    def cancel_requests(self, fences: list[Fence]) -> set[Fence]:
        """Which of these runs someone asked to cancel (between heartbeats, after a notification)."""
        with self.hot() as conn:
            return self.driver.cancel_requests(conn, fences)

    def write_progress(self, rows: list[tuple[Fence, Any]]) -> None:
        """Store the latest progress values of running jobs (fenced: a run no longer ours is skipped)."""
        with self.hot() as conn:
            self.driver.set_progress(conn, rows)

    def hand_back(self, fences: list[Fence]) -> int:
        """Shutdown: hand the runs still going back to the queue (the outcome policy's ``shutdown``)."""
        with self.hot() as conn:
            return hand_back_unfinished(self.driver, conn, fences)

    def hand_back_strays(self, known: Sequence[Fence]) -> int:
        """After an outage: hand back the runs the database holds under this worker's name that the worker
        does not know of, with their attempt refunded (``shutdown``'s verdict: they never started).

        A claim whose commit went through while its connection died before the reply came back leaves
        such rows: nobody runs them, and the reaper would charge each a lost attempt once the lease ran out.
        """
        ours = set(known)
        with self.driver.write(self.engine) as conn:
            strays = [(r.id, r.claim_token) for r in self.driver.held_by(conn, self.worker_name)
                      if (r.id, r.claim_token) not in ours]
            count = hand_back_unfinished(self.driver, conn, strays)
        if count:
            log.warning("worker %s: %d job(s) claimed as the connection dropped handed back, attempts refunded",
                        self.worker_name, count)
        return count

    # -- the rare outcomes -------------------------------------------------------------

    def settle(self, outcomes: list[Outcome]) -> None:
        """Write failures, snoozes, cancels, outages, hand-backs (and report committed / lost runs) as the
        outcome policy decides (``outcomes.settle``), all in one transaction: a broker-lost batch of the
        relay, or a burst of failures, is one commit, not one per job. Each is marked written and
        reported once the transaction has committed (a database error leaves them all to the next try)."""
        reports: list[tuple[Outcome, str]] = []
        rare = [o for o in outcomes if o.result not in ("committed", "lost")]
        if rare:
            with self.driver.write(self.engine) as conn:
                for o in rare:
                    reports.append((o, self._settle(conn, o)))
        for o in outcomes:
            o.written = True
        for o in outcomes:
            if o.result in ("committed", "lost"):
                self.report(o, "finished" if o.result == "committed" else "lost")
        for o, name in reports:
            self.report(o, name)

    def _settle(self, conn: Connection, o: Outcome) -> str:
        """One outcome through the policy, in ``conn``'s transaction; the name it is reported under."""
        job = o.job
        if o.park is not None:  # a durable sleep or wait: the park is written first, in this transaction
            o.delay = park_delay(self.driver, conn, job.id, o.park)
        # o.delay: a snooze's seconds, or the pause before a broker-lost batch is due again (the relay).
        verdict = settle(self.driver, conn, job.fence, o.result, job.attempt, job.max_attempts, error=o.error,
                         snooze=o.delay, pause=o.delay,
                         retry_delay=lambda: self.queue.retry_delay(job.kind, job.attempt))
        if verdict is not None:
            o.delay = verdict.delay
            return verdict.event
        # Not ours any more: a commit may have gone through with only its reply lost.
        return "finished" if o.committing and self.driver.finished_under(conn, job.fence) else "lost"

    def report_all(self, outcomes: list[Outcome], name: str) -> None:
        """``report`` of each of ``outcomes`` under one ``name`` (a batch's successes). When a report would
        neither log nor call a hook, only the count moves: checked once for the batch, not once per job.
        A store whose ``report`` does more (the relay's) overrides this too."""
        if log.isEnabledFor(_level(name)) or self.queue.listens(_EVENT[name]):
            for o in outcomes:
                self.report(o, name)
        else:
            self.processed += len(outcomes)

    def report(self, o: Outcome, name: str) -> None:
        job = o.job
        self.processed += 1
        level = _level(name)
        if log.isEnabledFor(level):  # this runs per job: format only what is printed
            log.log(level, "job %d %s attempt %d/%d (%.1f ms): %s", job.id, job.kind, job.attempt,
                    job.max_attempts, o.duration * 1000, _DETAIL[name].format(o=o))
        event = _EVENT[name]
        if self.queue.listens(event):
            self.queue.emit(JobEvent(event, job.id, job.kind, job.queue, job.attempt, job.max_attempts,
                                     o.duration, o.error or None))

    # -- housekeeping ------------------------------------------------------------------

    def reap(self) -> None:
        """Hand back jobs whose worker vanished, by the outcome policy's ``lost`` (the lost attempt counts,
        and the job's next run is alone in its worker process). Not in the first lease after the database
        server started (``Driver.expired``): live workers renew then what an outage let run out. Nor after
        waiting a third of a lease for SQLite's write lock (``hand_back_lost``'s ``patience``), nor within a
        lease of a write of this worker's that waited that long (``_hot``)."""
        if self.reaper_held():
            return
        hand_back_lost(self.queue, self.engine, self.driver,
                       lambda conn: self.driver.expired(conn, settle=self.lease),
                       "worker {row.locked_by} stopped heartbeating (lease expired)", patience=self.lease / 3)

    def upkeep(self) -> None:
        """The table's own upkeep (``Driver.upkeep``: the coming days' partitions of a partitioned table).

        A failure (the role may not create tables, say) is logged, not raised: the claims go on, and
        finished jobs land in the DEFAULT partition until a later round works.
        """
        try:
            with self.engine.begin() as conn:
                self.driver.upkeep(conn)
        except DBAPIError as exc:
            log.warning("worker %s: the table's upkeep failed, tried again later: %s",
                        self.worker_name, str(exc).splitlines()[0])

    def prune(self, older_than: float, batch: int) -> int:
        """Delete one batch of old finished jobs (one worker at a time: the driver's prune lock)."""
        deleted = self.queue.prune(self.engine, older_than=older_than, batch_size=batch, max_batches=1)
        if deleted:
            log.info("worker %s: pruned %d finished job(s) older than %gs", self.worker_name, deleted, older_than)
        return deleted
