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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from .._app import JobEvent, JobQueue
from ..drivers.base import Driver
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

    def reap(self) -> None:
        """Hand back the jobs of a relay that died (lease expired) in this relay's queues."""
        driver, queues = self.driver, set(self.queues or ())
        with driver.write(self.engine) as conn:
            rows = [r for r in driver.expired(conn, limit=self.batch * 4) if r.queue in queues]
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
