"""PostgreSQL: the jobs table's dead rows, counted and vacuumed (``sqla_jobs.worker.vacuum`` decides when),
the autovacuum trigger a plain jobs table is created with (``AUTOVACUUM``), and the oldest open transaction,
which no vacuum gets past (``drivers/_transactions.py``).

Mixed into ``PostgreSQLDriver``. A partitioned jobs table (``pg_partitions``) is
counted over its partitions, and ``VACUUM`` of the parent vacuums each of them.
"""

from __future__ import annotations

from sqlalchemy import Connection, Table, text

from .._transactions import OpenTransaction, oldest_of
from .notify import pg_name

__all__ = ["AUTOVACUUM", "PgVacuum", "autovacuum_ddl"]

#: The jobs table's own autovacuum trigger, set when sqla-jobs creates the table: a vacuum after every
#: 20,000 dead row versions (about 10,000 jobs: a claim and a finish leave one each), however many finished
#: rows it keeps. The server's default waits for 20 % of the table: never, for a table that keeps millions,
#: while every claim walks the dead index entries the claims before it left (docs/performance.md, "What
#: history costs"). Autovacuum visits a table at most once per naptime (a minute by default).
AUTOVACUUM = {"autovacuum_vacuum_scale_factor": "0", "autovacuum_vacuum_threshold": "20000"}

#: Sessions with a snapshot or a transaction id hold the horizon back; so does a prepared transaction.
#: Other roles' sessions show their times to a superuser or a member of pg_read_all_stats only.
_OLDEST = (
    "SELECT * FROM ("
    " SELECT extract(epoch FROM clock_timestamp() - xact_start) AS seconds,"
    "  format('session %s (application %L, %s)', pid, application_name, state) AS session,"
    "  format('SELECT pg_terminate_backend(%s)', pid) AS end_it"
    " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    "  AND xact_start IS NOT NULL AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)"
    " UNION ALL"
    " SELECT extract(epoch FROM clock_timestamp() - prepared), format('prepared transaction %L', gid),"
    "  format('ROLLBACK PREPARED %L', gid)"
    " FROM pg_prepared_xacts WHERE database = current_database()"
    ") AS open ORDER BY seconds DESC LIMIT 1"
)


class PgVacuum:
    """The vacuum hooks of ``Driver`` (see ``drivers/_operations.py``), for PostgreSQL."""

    jobs: Table

    def dead_rows(self, conn: Connection) -> int | None:
        # The statistics system's count: the server updates it about once a second, and it costs no scan.
        # A partitioned table's rows are in its partitions (pg_partition_tree; no rows for a plain table).
        return int(conn.execute(text(
            "SELECT coalesce(sum(s.n_dead_tup), 0) FROM pg_stat_user_tables AS s "
            "WHERE s.relid = to_regclass(:target) "
            "OR s.relid IN (SELECT relid FROM pg_partition_tree(to_regclass(:target)))"
        ), {"target": pg_name(self.jobs)}).scalar_one())

    def may_vacuum(self, conn: Connection) -> bool:
        # PostgreSQL 15 lets the table's owner, the database's owner and superusers vacuum; anyone else
        # gets a WARNING and nothing is done, so the worker asks first rather than vacuum in vain.
        return bool(conn.execute(text(
            "SELECT pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE') "
            "OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) "
            "FROM pg_class AS c, pg_database AS d WHERE c.oid = to_regclass(:target) "
            "AND d.datname = current_database()"
        ), {"target": pg_name(self.jobs)}).scalar())

    def vacuum(self, conn: Connection) -> None:
        # SKIP_LOCKED: if autovacuum or another worker's vacuum is at it, this one is not needed now.
        conn.execute(text(f"VACUUM (SKIP_LOCKED) {pg_name(self.jobs)}"))

    keeps_old_versions = True

    def oldest_transaction(self, conn: Connection) -> OpenTransaction | None:
        return oldest_of(conn, _OLDEST)

    def bench_vacuum(self, conn: Connection) -> None:
        conn.execute(text(f"VACUUM {pg_name(self.jobs)}"))


def autovacuum_ddl(table: Table) -> str:
    """PostgreSQL DDL giving the jobs table its ``AUTOVACUUM`` settings."""
    settings = ", ".join(f"{name} = {value}" for name, value in AUTOVACUUM.items())
    return f"ALTER TABLE {pg_name(table)} SET ({settings})"
