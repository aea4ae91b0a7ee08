"""One leader among the workers of a jobs table, for the maintenance that should run once.

Reaping expired leases, pruning old jobs, enqueueing periodic jobs and writing
dashboard samples need doing once per interval, not once per worker. The
workers elect a leader for them through a lease row in the database::

    from sqla_jobs.leader import Leadership

    leadership = Leadership(engine, queue, holder="worker-a", lease=15.0)
    if leadership.renew():          # call it every lease / 3 seconds
        ...                         # the maintenance; leadership.term numbers this reign

The row lives in ``<jobs table>_leader`` (``leader_table``): a name, its
holder, a term and an expiry, read and written with the database's clock. It
is an ordinary row, not a session advisory lock, so it works behind PgBouncer
in transaction mode and on SQLite and MariaDB alike.

The rules:

* **Taking over.** ``renew`` takes the lease when it is free or expired, and
  extends it when its holder asks; in one ``UPDATE`` whose condition only one
  of several racing workers can meet.
* **Terms.** The term grows by one whenever the lease changes hands or lapses.
  A log line says when a worker becomes leader and in which term.
* **Stepping down early.** A leader counts itself leader only until its lease
  would end, measured from *before* it asked for the renewal, less a safety
  margin (``is_leader``). A renewal that fails or hangs (a cut link, an
  outage) therefore ends its reign on its own clock, before the database lets
  anyone else take over: two leaders never act at once, as long as the two
  machines' clocks run at about the same rate (not in step: only durations
  are compared).
* **Handing over.** ``resign`` (on shutdown) lets the lease lapse at once, so
  the next worker takes over on its next renewal instead of a lease later. A
  leader that dies without resigning is replaced within a lease plus one
  renewal interval.
* **A lease that cannot work.** When renewals fail ``BROKEN_AFTER`` times in
  a row for a reason other than a lost connection (the table cannot be
  created, has another shape, or the role may not write it), ``broken``
  turns true and an error is logged: the worker then does its maintenance
  itself, as every worker did before elections, which is always safe. A
  later renewal that works ends that.

Declare the table in your metadata with ``leader_table(queue, Base.metadata)``
to have alembic autogenerate manage it; otherwise it is created on first use
(``CREATE TABLE IF NOT EXISTS``), like the dashboard's samples table.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, Column, Engine, MetaData, String, Table, inspect
from sqlalchemy.exc import SQLAlchemyError

from ._companion import companion_table
from ._models import timestamp_type
from .drivers import _leadership
from .errors import ConfigError

if TYPE_CHECKING:
    from ._app import JobQueue

__all__ = ["BROKEN_AFTER", "DEFAULT_LEASE", "Leadership", "leader_table"]

log = logging.getLogger("sqla_jobs")

#: Seconds a leader holds the lease without renewing it.
DEFAULT_LEASE = 15.0
#: The share of the lease a leader trusts itself for: the rest covers a slow round trip and clock drift.
_TRUST = 0.8
#: Renewals failing in a row (not for a lost connection) before the lease is taken as unusable.
BROKEN_AFTER = 3


def leader_table(queue: JobQueue[Any, Any], metadata: MetaData | None = None) -> Table:
    """``<jobs table>_leader`` of ``queue``, in the jobs table's schema (declared in ``metadata`` if given)."""
    return companion_table(queue, "leader", metadata, lambda name: [
        Column("name", String(64), primary_key=True),
        Column("holder", String(255), nullable=False),
        Column("term", BigInteger, nullable=False),
        Column("expires_at", timestamp_type(), nullable=False),
    ])


class Leadership:
    """One worker's side of the election for ``name`` on ``queue``'s jobs table; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        queue: JobQueue[Any, Any],
        holder: str,
        *,
        name: str = "maintenance",
        lease: float = DEFAULT_LEASE,
    ) -> None:
        if lease <= 0:
            raise ConfigError(f"the leader lease must be > 0 seconds, got {lease:g}")
        self.engine, self.queue, self.holder, self.name, self.lease = engine, queue, holder, name, lease
        self.table = leader_table(queue)
        self.term: int | None = None
        self._trusted_until = 0.0
        self._table_checked = False
        self._faults = 0  # renewals failed in a row, not for a lost connection

    @property
    def broken(self) -> bool:
        """Whether the lease itself looks unusable (see the module docstring): then do maintenance anyway."""
        return self._faults >= BROKEN_AFTER

    @property
    def is_leader(self) -> bool:
        """Whether this worker may act as leader now (its last renewal is recent enough)."""
        return self.term is not None and time.monotonic() < self._trusted_until

    def renew(self) -> bool:
        """Take or extend the lease; returns ``is_leader``. A database error counts as not leading."""
        asked = time.monotonic()
        try:
            self._ensure_table()
            driver = self.queue.driver(self.engine)
            with driver.write(self.engine) as conn:
                term = _leadership.take_or_renew(driver, conn, self.table, self.name, self.holder, self.lease)
        except SQLAlchemyError as exc:
            self._step_down(f"the lease could not be renewed ({type(exc).__name__})")
            if not self.queue.driver(self.engine).is_disconnect(exc):
                self._faults += 1
                if self._faults == BROKEN_AFTER:
                    log.error("leader: the lease in %s fails (%s); this worker does its own maintenance until it "
                              "works. Check the table: see leader_table() in sqla_jobs.leader",
                              self.table.name, str(exc).splitlines()[0])
            return False
        if self._faults >= BROKEN_AFTER:
            log.warning("leader: the lease in %s works again", self.table.name)
        self._faults = 0
        if term is None:
            self._step_down("another worker holds the lease")
            return False
        if term != self.term:
            log.info("leader: %s leads %s (term %d)", self.holder, self.table.name, term)
        self.term, self._trusted_until = term, asked + self.lease * _TRUST
        return True

    def resign(self) -> None:
        """Let the lease lapse now so another worker takes over at once (best effort: errors are logged)."""
        term, self.term, self._trusted_until = self.term, None, 0.0
        if term is None:
            return
        try:
            driver = self.queue.driver(self.engine)
            with driver.write(self.engine) as conn:
                _leadership.resign(driver, conn, self.table, self.name, self.holder, term)
            log.info("leader: %s handed %s over (term %d)", self.holder, self.table.name, term)
        except SQLAlchemyError as exc:
            log.warning("leader: could not hand the lease over (%s); it lapses in %gs", exc, self.lease)

    def _step_down(self, why: str) -> None:
        if self.term is not None:
            log.warning("leader: %s stops leading %s (term %d): %s", self.holder, self.table.name, self.term, why)
        self.term, self._trusted_until = None, 0.0

    def _ensure_table(self) -> None:
        if not self._table_checked:
            with self.engine.connect() as conn:
                if not inspect(conn).has_table(self.table.name, schema=self.table.schema):
                    self.table.create(conn, checkfirst=True)
                    conn.commit()
            self._table_checked = True
