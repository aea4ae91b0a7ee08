"""PostgreSQL, partitioned layout: locking a job's row that a concurrent finish moves to another partition.

Adding a dependent locks its upstreams' rows (``Graph.lock_upstreams``), and a
sequence's new job locks the key's last job the same way (``sqla_jobs._sequence``),
often while that job runs. If a worker finishes it meanwhile, the finish moves the
row from ``<table>_live`` to a ``<table>_done`` partition; in READ COMMITTED an
UPDATE that waited for the row can follow it to its new version, but not into
another partition: PostgreSQL raises a serialization failure instead (about 1 in
70 enqueues to a busy sequence did). A savepoint keeps the caller's transaction,
and the second try reads the job as it now is: finished, so nothing to wait for.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from ..base import Driver
from .partitions import is_partitioned

__all__ = ["MovedRows"]

_TRIES = 5


class MovedRows(Driver):
    """``lock_upstreams`` tried again when a row moved partition under it (module docstring)."""

    def lock_upstreams(self, conn: Connection, ids: Sequence[int]) -> dict[int, tuple[str, str | None]]:
        if not is_partitioned(conn, self.jobs):
            return super().lock_upstreams(conn, ids)
        for attempt in range(_TRIES):
            try:
                with conn.begin_nested():
                    return super().lock_upstreams(conn, ids)
            except DBAPIError as exc:
                if not self.is_conflict(exc) or attempt == _TRIES - 1:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises
