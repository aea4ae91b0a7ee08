"""``RelayStore``: the worker's ``Store`` with the three things a relay does its own way.

* Its reaper hands back only the expired jobs of its own queues, by the outcome
  policy's ``relay_lost`` (refunded up to ``MAX_UNCOUNTED_LOSSES`` times, a cancel
  request honoured), where a worker's reaper hands back every lost run as
  ``lost`` (counted, run alone next time): a relay that died mid-publish is not
  the job's fault, and no handler of the job ran.
* It keeps no limits across workers (a relayed job runs no handler) and does
  no table upkeep (the workers' elected leader does).
* Its report counts ``RelayCounts`` and, for the common case, only tells the
  hooks: the relay never logged a line per published job.
* Where the hot connection is in autocommit (PostgreSQL), the finish of the
  acknowledged jobs runs on a second connection while the next claim runs on
  the hot one: two statements the server runs side by side instead of one
  after the other, since the two touch different rows (the relay's claims
  and finishes were most of its time). Both are the worker's own statements.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from .._app import JobEvent, JobQueue
from ..drivers import connect_at
from ..drivers.base import Claimed, Driver, Fence
from ..worker.outcomes import settle
from ..worker.runs import Outcome
from ..worker.store import Store
from ._counts import RelayCounts

__all__ = ["RelayStore"]

log = logging.getLogger("sqla_jobs.relay")


class RelayStore(Store):
    def __init__(self, engine: Engine, app: JobQueue[Any, Any], driver: Driver, name: str, lease: float,
                 queues: Sequence[str], batch: int, counts: RelayCounts) -> None:
        super().__init__(engine, app, driver, name, lease, queues)
        self.limits, self.limited_kinds, self.limits_table = [], [], None
        self.batch = batch
        self.counts = counts
        self._finisher: ThreadPoolExecutor | None = None  # the thread of the second connection, once needed
        self._side: Connection | None = None  # touched on that thread only

    def finish_and_claim(self, ok: list[Outcome], limit: int, token: str, alone: bool,
                         queues: Sequence[str] | None = None, plain: bool = True) -> tuple[list[Claimed], bool, bool]:
        """The worker's ``finish_and_claim``, its finish on a second connection at the same time as the claim.

        Failures keep the control loop's rules: a claim that fails raises, after the finishes that
        committed are reported (marked written, so the retry does not write them again); a finish that
        fails raises too, after the jobs just claimed are handed back (the outcome policy's ``shutdown``:
        no attempt counted), so the retry finds both where they were.
        """
        if not ok or limit <= 0 or self.driver.hot_isolation != "AUTOCOMMIT":
            return super().finish_and_claim(ok, limit, token, alone, queues, plain)
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(1, thread_name_prefix="sqla-jobs-relay-finish")
        finishing = self._finisher.submit(self._finish, [o.job.fence for o in ok],
                                          [o.job.id for o in ok if o.job.has_dependents])
        try:
            claimed = super().finish_and_claim([], limit, token, alone, queues, plain)
        except BaseException:
            self._finished(ok, finishing, raise_error=False)
            raise
        try:
            self._finished(ok, finishing, raise_error=True)
        except BaseException:
            self.hand_back([job.fence for job in claimed[0]])
            raise
        return claimed

    def _finished(self, ok: list[Outcome], finishing: Future[set[int]], raise_error: bool) -> None:
        """Wait for the finish and report it (on the control loop's thread, as ``Store`` reports)."""
        try:
            kept = finishing.result()
        except BaseException:
            if raise_error:
                raise
            return  # the claim's error is the one raised; the outcomes stay unwritten for the retry
        kept = self.finish_declined(ok, kept)
        for o in ok:
            o.written = True
            self.report(o, "finished" if o.job.id in kept else "lost")

    def _finish(self, fences: list[Fence], upstreams: list[int]) -> set[int]:
        """The worker's fenced finish (its statement, with nothing to claim) on the second connection."""
        if self._side is None:
            self._side = connect_at(self.engine, "AUTOCOMMIT")
        try:
            kept, _, _ = self.driver.finish_and_claim(self._side, fences, 0, self.worker_name, "", self.lease,
                                                      self.queues, upstreams=upstreams)
        except DBAPIError:
            side, self._side = self._side, None
            try:
                side.invalidate()
                side.close()
            except Exception:  # already broken: nothing left to give back
                pass
            raise
        return kept

    def close(self) -> None:
        super().close()
        if self._finisher is not None:
            self._finisher.submit(self._close_side).result()
            self._finisher.shutdown()
            self._finisher = None

    def _close_side(self) -> None:
        side, self._side = self._side, None
        if side is not None:
            with contextlib.suppress(DBAPIError):  # the server already dropped it: nothing left to give back
                side.close()

    def reap(self) -> None:
        """Hand back the jobs of a relay that died (lease expired) in this relay's queues (not while the
        reaper is held: ``Store.waited``)."""
        if self.reaper_held():
            return
        driver, queues = self.driver, set(self.queues or ())
        with driver.write(self.engine) as conn:
            rows = [r for r in driver.expired(conn, limit=self.batch * 4, settle=self.lease) if r.queue in queues]
            for row in rows:
                settle(driver, conn, (row.id, row.claim_token), "relay_lost", row.attempts, row.max_attempts,
                       error=f"RelayLost: relay {row.locked_by} stopped before the broker acknowledged",
                       cancel_requested=row.cancelled_at is not None)
        if rows:
            self.counts.reaped += len(rows)
            log.warning("relay %s: handed back %d job(s) of a relay whose lease expired", self.worker_name,
                        len(rows))

    def upkeep(self) -> None:
        """None: the table's upkeep is the workers' leader's."""

    def report_all(self, outcomes: list[Outcome], name: str) -> None:
        for o in outcomes:  # each counted as published, or not, by report
            self.report(o, name)

    def report(self, o: Outcome, name: str) -> None:
        if o.result == "broker_lost":  # the relay logged the lost broker once for the batch; no hook, as ever
            self.processed += 1
            return
        if name != "finished":
            if name == "lost" and o.result == "ok":
                log.warning("relay %s: published job %d was no longer ours to finish (its lease ran out; it will "
                            "be published again under the same id)", self.worker_name, o.job.id)
            super().report(o, name)
            return
        self.processed += 1
        self.counts.published += 1
        if self.queue.listens("finished"):
            job = o.job
            self.queue.emit(JobEvent("finished", job.id, job.kind, job.queue, job.attempt, job.max_attempts,
                                     None, None))
