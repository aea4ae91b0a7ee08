"""What ``sqla-jobs bench`` asks of MariaDB/MySQL: a scratch database and old finished rows.

Mixed into ``MySQLDriver``; kept apart because none of it runs in an application.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Table, create_engine, text
from sqlalchemy.engine import URL

__all__ = ["MySQLBench"]


class MySQLBench:
    """The bench hooks of ``Driver`` (see ``drivers/_setup.py``), for MariaDB/MySQL."""

    jobs: Table

    @classmethod
    @contextmanager
    def bench_scratch(cls, url: URL) -> Iterator[URL]:
        database = f"sqla_jobs_bench_{os.getpid()}"
        admin = create_engine(url)
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{database}`"))
            conn.execute(text(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4"))
        try:
            yield url.set(database=database)
        finally:
            with admin.begin() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS `{database}`"))
            admin.dispose()

    def bench_analyze(self, conn: Connection) -> None:
        conn.execute(text(f"ANALYZE TABLE {self._quoted(conn)}"))

    def bench_fill_finished(self, conn: Connection, rows: int) -> None:
        """One row, then ``INSERT … SELECT`` doubling it on the server: a million rows in seconds."""
        table = self._quoted(conn)
        columns = "kind, queue, payload, state, attempts, locked_at, finished_at"
        conn.execute(text(
            f"INSERT INTO {table} ({columns}) VALUES ('noop', 'default', '{{}}', 'finished', 1, "
            "UTC_TIMESTAMP(6) - INTERVAL 1 DAY, UTC_TIMESTAMP(6) - INTERVAL 1 DAY)"
        ))
        done = 1
        while done < rows:
            step = min(done, rows - done)
            conn.execute(text(
                f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table} WHERE state = 'finished' LIMIT {step}"
            ))
            done += step
        conn.execute(text(f"ANALYZE TABLE {table}"))

    def _quoted(self, conn: Connection) -> str:
        return str(conn.dialect.identifier_preparer.format_table(self.jobs))
