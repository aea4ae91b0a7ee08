"""MariaDB/MySQL's stats queries: no ``FILTER`` clause there, so a ``CASE`` inside each aggregate; and the
oldest open transaction, which InnoDB's purge of old row versions waits for (``drivers/_transactions.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Table, case, func, select
from sqlalchemy.sql.elements import ColumnElement

from .._transactions import OpenTransaction, oldest_of

__all__ = ["MySQLStats"]

#: InnoDB lists a transaction once it has read or written a table; seeing other users' needs PROCESS.
_OLDEST = (
    "SELECT TIMESTAMPDIFF(MICROSECOND, t.trx_started, NOW(6)) / 1e6 AS seconds,"
    " CONCAT('connection ', t.trx_mysql_thread_id, ' (user ', QUOTE(COALESCE(p.USER, '?')), ', ',"
    "  IF(p.COMMAND = 'Sleep', 'idle in a transaction', LOWER(COALESCE(p.COMMAND, 'unknown'))), ')') AS session,"
    " CONCAT('KILL ', t.trx_mysql_thread_id) AS end_it"
    " FROM information_schema.INNODB_TRX AS t"
    " LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = t.trx_mysql_thread_id"
    " WHERE t.trx_mysql_thread_id <> CONNECTION_ID() ORDER BY t.trx_started LIMIT 1"
)


class MySQLStats:
    """Mixed in before ``Driver`` by ``MySQLDriver``: the per-queue and dead-letter counts."""

    jobs: Table
    dead: Table

    if TYPE_CHECKING:  # Driver's, which comes after this class in MySQLDriver's bases
        def now(self) -> Any: ...

        def ago(self, seconds: float) -> Any: ...

        def seconds_between(self, later: Any, earlier: Any) -> Any: ...

    @staticmethod
    def _count_if(condition: ColumnElement[bool]) -> ColumnElement[int]:
        return func.count(case((condition, 1)))

    def pending_by_queue(self, conn: Connection) -> list[Any]:
        t, now = self.jobs, self.now()
        due = t.c.run_at <= now
        oldest = (
            select(
                t.c.queue,
                self._count_if(due).label("ready"),
                self._count_if(~due).label("scheduled"),
                func.min(case((due, t.c.run_at))).label("oldest_due"),
            )
            .where(t.c.state == "pending")
            .group_by(t.c.queue)
            .subquery()
        )
        age = self.seconds_between(now, oldest.c.oldest_due)
        stmt = select(oldest.c.queue, oldest.c.ready, oldest.c.scheduled, age.label("oldest_age"))
        return list(conn.execute(stmt.order_by(oldest.c.queue)))

    def running_by_queue(self, conn: Connection) -> list[Any]:
        t = self.jobs
        stmt = (
            select(t.c.queue, func.count().label("running"),
                   self._count_if(t.c.lease_expires_at < self.now()).label("expired"))
            .where(t.c.state == "running")
            .group_by(t.c.queue)
            .order_by(t.c.queue)
        )
        return list(conn.execute(stmt))

    def dead_by_kind(self, conn: Connection, window: float) -> list[Any]:
        d = self.dead
        stmt = (
            select(d.c.kind, func.count().label("total"),
                   self._count_if(d.c.failed_at >= self.ago(window)).label("recent"))
            .group_by(d.c.kind)
            .order_by(d.c.kind)
        )
        return list(conn.execute(stmt))

    keeps_old_versions = True

    def oldest_transaction(self, conn: Connection) -> OpenTransaction | None:
        return oldest_of(conn, _OLDEST)
