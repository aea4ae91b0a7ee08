"""Vacuuming the jobs table during a burst: ``Worker(vacuum_dead_rows=N)``, ``--vacuum-dead-rows N``.

Every claim and every finish on PostgreSQL leaves the job's old row version
behind, dead, and its entry in the pending index with it. The claim walks that
index from its head, which is exactly where the dead entries of the jobs just
taken pile up, so until a ``VACUUM`` removes them each claim steps over all of
them: in a drain of 300,000 jobs the walk grew from about 170 to about 1,500
index pages per claim, and the drain ran a third slower than a short burst
(docs/performance.md, "Large backlogs"). Autovacuum keeps up with a steady
stream, but it looks at each database once a minute (``autovacuum_naptime``)
and waits for a fifth of the table to be dead: a burst of a few hundred
thousand jobs is over before it starts.

With ``vacuum_dead_rows=N`` the worker that does the upkeep (the elected one,
``sqla_jobs.leader``; every worker in burst mode or with ``leader=False``)
reads the table's dead-row count from the server's statistics once a second
and runs ``VACUUM (SKIP_LOCKED)`` on the jobs table when it reaches ``N``. It
runs on a thread of its own, so the worker's claims go on meanwhile, and
``SKIP_LOCKED`` lets a vacuum already at work (autovacuum's, another
worker's) do it instead. Off by default: vacuuming is the server's business
unless a burst needs it sooner. PostgreSQL only: MariaDB's purge thread and
SQLite's in-place updates leave nothing for a worker to reclaim, so there the
setting logs that it does nothing. The role must be allowed to vacuum the
table (its owner, the database's owner or a superuser); if it is not, the
worker logs an error saying so once and goes on without vacuuming.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from ..drivers import connect_at

if TYPE_CHECKING:
    from .._app import JobQueue

log = logging.getLogger("sqla_jobs.worker")

__all__ = ["CHECK_EVERY", "Vacuumer"]

#: Seconds between two looks at the dead-row count (the server refreshes it about once a second).
CHECK_EVERY = 1.0


class Vacuumer:
    """The thread that vacuums the jobs table when ``threshold`` dead rows are in it, while ``acting()``."""

    def __init__(self, queue: JobQueue[Any, Any], engine: Engine, threshold: int, acting: Callable[[], bool],
                 every: float = CHECK_EVERY) -> None:
        self.queue = queue
        self.engine = engine
        self.threshold = threshold
        self.acting = acting
        self.every = every
        self.vacuums = 0  # how many VACUUMs this worker ran (tests and logs read it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="sqla-jobs-vacuum", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def check(self) -> bool | None:
        """One look: vacuum if the count has reached the threshold. True: vacuumed; False: not needed
        now; None: never on this database (the backend has nothing to vacuum, or the role may not)."""
        with connect_at(self.engine, "AUTOCOMMIT") as conn:
            driver = self.queue.driver(conn)
            dead = driver.dead_rows(conn)
            if dead is None:
                log.info("vacuum_dead_rows: %s reclaims dead rows itself; the worker does not vacuum", driver.name)
                return None
            if dead < self.threshold:
                return False
            if not driver.may_vacuum(conn):
                log.error("vacuum_dead_rows: this role may not VACUUM %s (it must own the table or the database, "
                          "or be a superuser); the worker goes on without vacuuming. Connect as the table's owner "
                          "or drop --vacuum-dead-rows", driver.jobs.name)
                return None
            started = time.monotonic()
            driver.vacuum(conn)
        self.vacuums += 1
        log.info("vacuumed %s: %d dead rows, in %.0f ms", driver.jobs.name, dead, (time.monotonic() - started) * 1000)
        return True

    def _main(self) -> None:
        failures = 0
        while not self._stop.wait(self.every if not failures else min(60.0, self.every * 2 ** failures)):
            if not self.acting():
                continue
            try:
                if self.check() is None:
                    return
                failures = 0
            except Exception as exc:  # an outage: the control loop reports those; look again later
                failures += 1
                if failures <= 3:
                    log.warning("vacuum_dead_rows: could not vacuum the jobs table (attempt %d): %s",
                                failures, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
