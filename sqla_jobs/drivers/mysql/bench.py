"""What ``sqla-jobs bench`` asks of MariaDB/MySQL: a scratch database and old finished rows.

Mixed into ``MySQLDriver``; kept apart because none of it runs in an application.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Table, create_engine, text
from sqlalchemy.engine import URL

from ...errors import ConfigError
from .._setup import SCRATCH_PREFIX

__all__ = ["MySQLBench"]


def _drop_abandoned(conn: Connection) -> None:
    """Drop the scratch databases no running bench holds (a bench killed with SIGKILL leaves its own)."""
    names = conn.execute(text("SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE :like"),
                         {"like": SCRATCH_PREFIX.replace("_", "\\_") + "%"}).scalars().all()
    for name in names:
        if conn.execute(text("SELECT GET_LOCK(:name, 0)"), {"name": name}).scalar_one() == 1:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
            conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": name})


class MySQLBench:
    """The bench hooks of ``Driver`` (see ``drivers/_setup.py``), for MariaDB/MySQL."""

    jobs: Table

    @classmethod
    @contextmanager
    def bench_scratch(cls, url: URL) -> Iterator[URL]:
        # The bench holds a named lock (GET_LOCK) called after its database while it runs: a scratch database
        # whose lock is free was left by a bench killed with SIGKILL (its session, and the lock, ended with it).
        database = f"{SCRATCH_PREFIX}{os.getpid()}"
        admin = create_engine(url)
        holder = admin.connect().execution_options(isolation_level="AUTOCOMMIT")  # never idle in a transaction
        try:
            if holder.execute(text("SELECT GET_LOCK(:name, 0)"), {"name": database}).scalar_one() != 1:
                raise ConfigError(f"scratch database {database} is in use by another bench (on another machine, "
                                  "with this one's process id): run this one again")
            _drop_abandoned(holder)
            with admin.begin() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS `{database}`"))
                conn.execute(text(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4"))
            try:
                yield url.set(database=database)
            finally:
                with admin.begin() as conn:
                    conn.execute(text(f"DROP DATABASE IF EXISTS `{database}`"))
                holder.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": database})
        finally:
            holder.close()
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
