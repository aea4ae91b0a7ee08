"""The oldest transaction open in the database: what keeps the jobs table's old row versions.

A claim and a finish each leave a row version behind, and the database may only
reclaim it (PostgreSQL's VACUUM, InnoDB's purge) once no open transaction could
still read it. One session left idle in a transaction, however quiet, holds that
cleanup back for as long as it stays open: dead versions pile up, every claim
walks over more of them, and the queue slows down (``sqla-jobs bench``'s plain
drain ran at a third of its speed beside one such session, docs/performance.md).
``sqla-jobs health --max-transaction-age`` reports it, naming the session.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

__all__ = ["OpenTransaction", "OpenTransactions", "oldest_of"]


@dataclass(frozen=True)
class OpenTransaction:
    """A transaction open in the database, other than the asking connection's."""

    #: How long it has been open, by the database clock.
    seconds: float
    #: The session as the server names it, e.g. ``session 1234 (application 'psql', idle in transaction)``.
    session: str
    #: What ends it (a statement to run as a privileged user).
    end_it: str


class OpenTransactions:
    """The hook of ``Driver``; backends without a cleanup that transactions hold back keep the default."""

    #: Whether ``oldest_transaction`` can say anything: old row versions that an open transaction keeps.
    keeps_old_versions = False

    def oldest_transaction(self, conn: Connection) -> OpenTransaction | None:
        """The oldest transaction open in this database other than ``conn``'s, or None: none is open, or
        the backend has no such cleanup (SQLite)."""
        return None


def oldest_of(conn: Connection, query: str) -> OpenTransaction | None:
    """The first row of ``query``, which lists open transactions (``seconds``, ``session``, ``end_it``) oldest
    first."""
    row = conn.execute(text(query)).first()
    return None if row is None else OpenTransaction(float(row.seconds), row.session, row.end_it)
