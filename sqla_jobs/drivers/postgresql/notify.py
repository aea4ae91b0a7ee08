"""PostgreSQL's wake-up trigger: its channel, name and DDL (the worker LISTENs on the channel).

A statement-level trigger on the jobs table NOTIFYs at commit, so a worker
waiting in ``pg_listen`` claims a new job about a millisecond after the
enqueuing transaction commits. ``create-tables`` creates it with the table and
``migrations render`` writes it into revisions (autogenerate cannot see
triggers).
"""

from __future__ import annotations

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql

__all__ = ["notify_channel", "notify_trigger_ddl", "notify_trigger_name", "pg_name"]


def notify_channel(table: Table) -> str:
    """The LISTEN/NOTIFY channel of one jobs table (PostgreSQL caps names at 63 bytes)."""
    name = f"sqla_jobs.{table.schema}.{table.name}" if table.schema else f"sqla_jobs.{table.name}"
    return name[:63]


def pg_name(table: Table) -> str:
    """The table's name as PostgreSQL wants it in hand-written SQL: quoted where needed, with its schema."""
    return str(postgresql.dialect().identifier_preparer.format_table(table))


def notify_trigger_name(table: Table) -> str:
    return f"{table.name}_notify"[:63]


def notify_trigger_ddl(table: Table) -> tuple[str, str]:
    """PostgreSQL DDL (create, drop) for the trigger that wakes workers on INSERT.

    A statement-level AFTER INSERT trigger: one NOTIFY per INSERT or COPY,
    delivered at commit, dropped on rollback, and no extra round trip for
    the application that enqueues. It also fires for rows inserted by
    plain SQL from other programs.
    """
    preparer = postgresql.dialect().identifier_preparer
    target = pg_name(table)
    schema = f"{preparer.quote_schema(table.schema)}." if table.schema else ""
    function = f"{schema}sqla_jobs_notify"
    trigger = preparer.quote(notify_trigger_name(table))
    channel = notify_channel(table).replace("'", "''")
    create = (
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_notify(TG_ARGV[0], ''); RETURN NULL; END $$;\n"
        f"CREATE TRIGGER {trigger} AFTER INSERT ON {target} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}('{channel}')"
    )
    drop = f"DROP TRIGGER IF EXISTS {trigger} ON {target}"
    return create, drop
