"""Who does the worker's share of the table's upkeep: reaping expired leases and pruning.

Without an election (``Worker(leader=False)``, ``--no-leader``, burst mode)
every worker does it, as before elections existed: each step is safe from many
workers at once. With one, only the elected worker does (``sqla_jobs.leader``),
and any worker does when the lease itself cannot work (``Leadership.broken``).
Periodic slots are not upkeep: every long-running worker offers them, so a
slot never waits for a new leader, and the database lets one job per slot in.
"""

from __future__ import annotations

from ..leader import Leadership

__all__ = ["Maintenance"]


class Maintenance:
    """The control loop asks ``renew`` at each heartbeat; others ask ``acting`` in between."""

    def __init__(self, leadership: Leadership | None) -> None:
        self.leadership = leadership

    def renew(self) -> bool:
        """Renew the lease (if elected); whether this worker should do the upkeep until the next heartbeat."""
        if self.leadership is None:
            return True
        return self.leadership.renew() or self.leadership.broken

    @property
    def acting(self) -> bool:
        """Whether this worker does the upkeep now (no round trip)."""
        return self.leadership is None or self.leadership.is_leader or self.leadership.broken

    def resign(self) -> None:
        if self.leadership is not None:
            self.leadership.resign()
