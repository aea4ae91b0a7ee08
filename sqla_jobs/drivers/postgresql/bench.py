"""What ``sqla-jobs bench`` asks of PostgreSQL: a scratch schema, finished rows, table statistics, storage.

Mixed into ``PostgreSQLDriver``; kept apart because none of it runs in an application.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Table, create_engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL

from ...errors import ConfigError
from .._setup import SCRATCH_PREFIX
from .notify import pg_name

__all__ = ["LOCK_SPACE", "PgBench"]
#: The first key of the advisory locks the benches hold on their scratch schemas (the second: the name's hash).
LOCK_SPACE = 0x5B3C4
_KEY = "CAST(:space AS integer), hashtext(:schema)"


def _drop_abandoned(conn: Connection) -> None:
    """Drop the scratch schemas no running bench holds (a bench killed with SIGKILL leaves its own)."""
    names = conn.execute(text("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, :prefix)"),
                         {"prefix": SCRATCH_PREFIX}).scalars().all()
    for name in names:
        key = {"space": LOCK_SPACE, "schema": name}
        if conn.execute(text(f"SELECT pg_try_advisory_lock({_KEY})"), key).scalar_one():
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
            conn.execute(text(f"SELECT pg_advisory_unlock({_KEY})"), key)


class PgBench:
    """The bench hooks of ``Driver`` (see ``drivers/base.py``), for PostgreSQL."""

    jobs: Table

    def open_connections(self, conn: Connection) -> int | None:
        return int(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"))
                   .scalar_one())

    @classmethod
    @contextmanager
    def bench_scratch(cls, url: URL) -> Iterator[URL]:
        # The bench holds an advisory lock named after its schema while it runs: a scratch schema whose lock
        # is free was left by a bench killed with SIGKILL (its session, and the lock, ended with it).
        schema = f"{SCRATCH_PREFIX}{os.getpid()}"
        admin = create_engine(url)
        # Autocommit: a session idle in a transaction would hold back PostgreSQL's vacuum horizon all along.
        holder = admin.connect().execution_options(isolation_level="AUTOCOMMIT")
        key = {"space": LOCK_SPACE, "schema": schema}
        try:
            if not holder.execute(text(f"SELECT pg_try_advisory_lock({_KEY})"), key).scalar_one():
                raise ConfigError(f"scratch schema {schema} is in use by another bench (on another machine, "
                                  "with this one's process id): run this one again")
            _drop_abandoned(holder)
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            try:
                yield url.update_query_dict({"options": f"-csearch_path={schema}"})
            finally:
                with admin.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
                # Said, not left to the session's end: behind PgBouncer the server session outlives ours.
                holder.execute(text(f"SELECT pg_advisory_unlock({_KEY})"), key)
        finally:
            holder.close()
            admin.dispose()

    def bench_fill_finished(self, conn: Connection, rows: int) -> None:
        conn.execute(text(
            f"INSERT INTO {pg_name(self.jobs)} (kind, queue, payload, state, attempts, locked_at, finished_at) "
            "SELECT 'noop', 'default', '{}'::jsonb, 'finished', 1, now() - interval '1 day', "
            "now() - interval '1 day' FROM generate_series(1, :n)"
        ), {"n": rows})
        conn.execute(text(f"ANALYZE {pg_name(self.jobs)}"))

    def bench_table_stats(self, conn: Connection) -> dict[str, float]:
        # The statistics collector's counters reach pg_stat_user_tables within a second or so.
        row = conn.execute(text(
            "SELECT pg_relation_size(s.relid) AS table_bytes, pg_indexes_size(s.relid) AS index_bytes, "
            "s.n_live_tup AS live_tuples, s.n_dead_tup AS dead_tuples, "
            "s.n_tup_hot_upd::float8 / NULLIF(s.n_tup_upd, 0) AS hot_update_share, "
            "s.autovacuum_count, s.autoanalyze_count, s.vacuum_count, s.n_tup_upd AS updates, "
            "(current_setting('autovacuum') = 'on')::int AS autovacuum_on "
            "FROM pg_stat_user_tables AS s WHERE s.relid = to_regclass(:target)"
        ), {"target": pg_name(self.jobs)}).mappings().first()
        return {k: float(v) for k, v in row.items() if v is not None} if row else {}

    def bench_storage(self, conn: Connection, parameters: dict[str, str]) -> None:
        preparer = postgresql.dialect().identifier_preparer
        settings = []
        for name, value in parameters.items():
            if not name.replace("_", "").isalnum() or not value.replace(".", "").replace("_", "").isalnum():
                raise ConfigError(f"--storage: {name}={value} is not a storage parameter (e.g. fillfactor=70)")
            settings.append(f"{preparer.quote(name)} = {value}")
        conn.execute(text(f"ALTER TABLE {pg_name(self.jobs)} SET ({', '.join(settings)})"))

    bench_cuts_connections = True

    def bench_cut_connections(self, conn: Connection) -> int:
        # Workers name their connections (keepalive.py): the soak's own producer and monitor are spared.
        return int(conn.execute(text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND application_name LIKE 'sqla-jobs worker %'")).scalar_one())
