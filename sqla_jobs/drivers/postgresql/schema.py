"""The job tables as PostgreSQL stores them: column types, the generated column, the schemas, the wake-up
trigger beside the table, and index reflection for the alembic comparator.

Mixed into ``PostgreSQLDriver``. JSON columns are ``jsonb``; the ``unique_held`` generated column is
STORED (a VIRTUAL one, PostgreSQL 18's default, cannot be indexed); indexes may be partial.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import DDL, Computed, Connection, String, Table, cast, event, inspect, literal, text
from sqlalchemy.dialects.postgresql import JSON, JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateSchema
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeEngine

from .._setup import GeneratedColumn, IndexDefinition
from ..base import Driver
from . import partitions
from .notify import notify_trigger_ddl, notify_trigger_name, pg_name
from .vacuum import autovacuum_ddl

__all__ = ["PgSchema"]


@compiles(GeneratedColumn, "postgresql")
def _stored(element: GeneratedColumn, compiler: Any, **kw: Any) -> str:
    # Stored on every version: PostgreSQL 18 would make it VIRTUAL, which no index can cover.
    return str(compiler.visit_computed_column(Computed(element.sqltext, persisted=True), **kw))


class PgSchema(Driver):
    """The class-level hooks of ``drivers/_setup.py`` that say how PostgreSQL stores the job tables, and
    their creation (schemas, tables, the wake-up trigger)."""

    partial_indexes = True
    stores_generated_columns = True
    migration_imports = ("from sqlalchemy.dialects import postgresql",)

    @classmethod
    def column_type(cls, role: str) -> TypeEngine[Any] | None:
        return JSONB() if role == "json" else None

    @classmethod
    def render_type(cls, type_: Any, imports: set[str], prefix: str) -> str | None:
        if not isinstance(type_, (JSONB, JSON)):
            return None
        imports.add("from sqlalchemy.dialects import postgresql")
        # repr is e.g. "JSONB(astext_type=Text())"; Text is only importable via sa.
        return "postgresql." + repr(type_).replace("astext_type=Text(", f"astext_type={prefix}Text(")

    @classmethod
    def json_field_text(cls, document: ColumnElement[Any], field: str) -> ColumnElement[str]:
        return document.op("->>", return_type=String())(cast(literal(field), String()))  # jsonb ->> text

    @classmethod
    def attach_table_events(cls, table: Table) -> None:
        create, _drop = notify_trigger_ddl(table)
        event.listen(table, "after_create", DDL(create).execute_if(dialect=cls.name))
        event.listen(table, "after_create", DDL(autovacuum_ddl(table)).execute_if(dialect=cls.name))

    @classmethod
    def table_settings_migration(cls, table: Table) -> str | None:
        return (f'    if op.get_bind().dialect.name == "{cls.name}":\n'
                "        # vacuum by a count of dead rows, not a share of the table: see "
                "sqla_jobs.drivers.postgresql.vacuum.AUTOVACUUM\n"
                f"        op.execute({autovacuum_ddl(table)!r})")

    @classmethod
    def wake_trigger_migration(cls, table: Table) -> tuple[str, str, str] | None:
        create, drop = notify_trigger_ddl(table)
        function, trigger = create.split(";\n")
        guard = f'    if op.get_bind().dialect.name == "{cls.name}":\n'
        upgrade = (guard + "        # wakes idle workers at commit (LISTEN/NOTIFY); see "
                   "sqla_jobs.drivers.postgresql.driver.notify_trigger_ddl\n"
                   f"        op.execute({function!r})\n        op.execute({trigger!r})")
        summary = f"create trigger {notify_trigger_name(table)} ({cls.label})"
        return upgrade, guard + f"        op.execute({drop!r})", summary

    @classmethod
    def creates_schemas(cls) -> bool:
        return True

    @classmethod
    def reflect_indexes(cls, conn: Connection, schema: str | None, table: str) -> dict[str, IndexDefinition | None]:
        found: dict[str, IndexDefinition | None] = {}
        for index in inspect(conn).get_indexes(table, schema=schema):
            expressions = index.get("expressions") or index.get("column_names") or []
            if any(e is None for e in expressions):
                found[str(index["name"])] = None  # an expression this SQLAlchemy cannot reflect: it only exists
                continue
            sorting: dict[str, Any] = dict(index.get("column_sorting") or {})
            elements = tuple(f"{e} DESC" if "desc" in sorting.get(e, ()) else str(e) for e in expressions)
            where = (index.get("dialect_options") or {}).get("postgresql_where")
            found[str(index["name"])] = (bool(index.get("unique")), elements, str(where) if where is not None else None)
        return partitions.as_the_model_has_them(conn, schema, table, found, cls.reflect_indexes)

    def create(self, conn: Connection) -> None:
        for schema in sorted({t.schema for t in (self.jobs, self.dead) if t.schema}):
            conn.execute(CreateSchema(schema, if_not_exists=True))
        super().create(conn)
        if not self.has_notify_trigger(conn):
            conn.execute(text(notify_trigger_ddl(self.jobs)[0]))

    def has_notify_trigger(self, conn: Connection) -> bool:
        found = conn.execute(
            text("SELECT 1 FROM pg_trigger WHERE tgname = :name AND tgrelid = to_regclass(:target)"),
            {"name": notify_trigger_name(self.jobs), "target": pg_name(self.jobs)},
        ).first()
        return found is not None
