"""The app's reads of batches: ``queue.batch(bind, id)`` and ``queue.batches(bind)`` (a mixin of ``JobQueue``).

See ``sqla_jobs._batch`` for what a batch is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from ._admin import _connection
from ._batch import BatchStatus, status_of

if TYPE_CHECKING:
    from .drivers import Driver

__all__ = ["BatchAdmin", "BatchSummary"]


@dataclass(frozen=True)
class BatchSummary:
    """A batch as ``queue.batches`` lists it: no member counts (they read every member), its callbacks' states."""

    id: int
    label: str | None
    created_at: datetime
    total: int
    callbacks: dict[str, tuple[int, str | None]]


class BatchAdmin:
    """``queue.batch`` and ``queue.batches``."""

    if TYPE_CHECKING:
        def driver(self, bind: Engine | Connection) -> Driver: ...

    def batch(self, bind: Session | Engine | Connection, batch_id: int) -> BatchStatus | None:
        """How batch ``batch_id`` stands (``BatchStatus``: member counts, callbacks' states), or None.
        Reads every member's state: one statement, about 50 ms per 100,000 members on PostgreSQL."""
        with _connection(bind) as conn:
            driver = self.driver(conn)
            return status_of(driver, conn, driver.batch_row(conn, batch_id))

    def batches(self, bind: Session | Engine | Connection, *, limit: int = 50,
                before: int | None = None) -> list[BatchSummary]:
        """The newest batches (ids below ``before``, to page on), at most ``limit``."""
        with _connection(bind) as conn:
            rows = self.driver(conn).list_batches(conn, limit, before)
        names = ("on_complete", "on_success", "on_failure")
        return [BatchSummary(id=r.id, label=r.label, created_at=r.created_at, total=r.total,
                             callbacks={n: (getattr(r, f"{n}_id"), getattr(r, f"{n}_state"))
                                        for n in names if getattr(r, f"{n}_id") is not None})
                for r in rows]
