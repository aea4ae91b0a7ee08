"""PostgreSQL: ``COPY … FROM STDIN``, the fastest way to write many rows (``enqueue_many``, a graph's edges)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Table
from sqlalchemy.util import await_only

from .claim import is_async

if TYPE_CHECKING:
    import psycopg

__all__ = ["copy_rows"]


def copy_rows(conn: Connection, table: Table, columns: Sequence[str], values: Iterable[Sequence[Any]]) -> None:
    """COPY ``values`` (one sequence per row, in ``columns`` order) into ``table``, in ``conn``'s transaction."""
    target = conn.dialect.identifier_preparer.format_table(table)
    if not conn.in_transaction():
        # SQLAlchemy does not see what the driver cursor runs: without this its commit would be a no-op.
        conn.begin()
    raw = conn.connection.driver_connection
    sql = f"COPY {target} ({', '.join(columns)}) FROM STDIN"
    if is_async(raw):  # queue.aio, an AsyncSession's flush: we run in a greenlet, so await
        await_only(_copy_async(raw, sql, values))
        return
    with raw.cursor().copy(sql) as copy:  # type: ignore[union-attr]
        for value in values:
            copy.write_row(value)


async def _copy_async(raw: psycopg.AsyncConnection[Any], sql: str, values: Iterable[Sequence[Any]]) -> None:
    """``COPY ... FROM STDIN`` through psycopg's async connection (``postgresql+psycopg`` under asyncio)."""
    async with raw.cursor() as cursor, cursor.copy(sql) as copy:
        for value in values:
            await copy.write_row(value)
