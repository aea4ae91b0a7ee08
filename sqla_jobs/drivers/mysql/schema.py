"""The job tables as MariaDB/MySQL store them: column types, table options, their DDL and index reflection.

Mixed into ``MySQLDriver``. JSON is kept as ``LONGTEXT`` (``JSONText``), timestamps as
``DATETIME(6)`` in UTC (the server default ``UTC_TIMESTAMP(6)``), kind and queue under a binary
collation, and the indexes have no WHERE (MySQL has no partial indexes: ``state`` leads them).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Table, func, text
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateIndex
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeEngine

from .._setup import DatabaseNow, IndexDefinition
from ..base import Driver

__all__ = ["DATETIME6", "JSONText", "MySQLSchema"]

#: Every timestamp column: DATETIME keeps whole seconds unless asked, and leases and claim order need microseconds.
DATETIME6 = mysql.DATETIME(fsp=6)


class JSONText(mysql.JSON):
    """JSON stored as ``LONGTEXT``: the text exactly as sent, read back with ``json.loads``.

    Not the ``JSON`` column type: MySQL 8 stores it in a binary form that
    reorders keys and respells numbers, and MariaDB's ``JSON`` (an alias of
    LONGTEXT) adds a ``JSON_VALID`` check that refuses documents nested more
    than 32 levels, under the 64 sqla-jobs accepts. Payloads are validated
    before they are sent (``sqla_jobs._payload``), so nothing is lost.
    """

    cache_ok = True


@compiles(JSONText, "mysql")
@compiles(JSONText, "mariadb")
def _json_as_longtext(element: JSONText, compiler: Any, **kw: Any) -> str:
    return "LONGTEXT"


@compiles(DatabaseNow, "mysql")
@compiles(DatabaseNow, "mariadb")
def _utc_default(element: DatabaseNow, compiler: Any, **kw: Any) -> str:
    # DATETIME has no time zone: CURRENT_TIMESTAMP would be the session's local time, in whole seconds;
    return "(UTC_TIMESTAMP(6))"  # parenthesised, as MySQL 8 wants an expression default


class MySQLSchema(Driver):
    """The class-level hooks of ``drivers/_setup.py`` that say how MariaDB/MySQL store the job tables,
    and the tables' creation."""

    dialects = ("mysql", "mariadb")
    migration_imports = ("from sqlalchemy.dialects import mysql",)

    @classmethod
    def column_type(cls, role: str) -> TypeEngine[Any] | None:
        return {"json": JSONText(), "timestamp": DATETIME6}.get(role)

    @classmethod
    def table_options(cls, table: str) -> dict[str, Any]:
        # Compare kind and queue exactly: the default collation would hold "Emails" and "emails" the same.
        return {f"{dialect}_{option}": value for dialect in cls.dialects
                for option, value in (("charset", "utf8mb4"), ("collate", "utf8mb4_bin"))}

    @classmethod
    def render_type(cls, type_: Any, imports: set[str], prefix: str) -> str | None:
        if not isinstance(type_, JSONText):
            return None
        imports.add("from sqlalchemy.dialects import mysql")  # the revision needs only LONGTEXT
        return "mysql.LONGTEXT()"

    @classmethod
    def json_field_text(cls, document: ColumnElement[Any], field: str) -> ColumnElement[str]:
        # The column is LONGTEXT holding JSON: JSON_EXTRACT parses it, JSON_UNQUOTE makes a string of the value.
        return func.json_unquote(func.json_extract(document, f'$."{field}"'))

    @classmethod
    def reflect_indexes(cls, conn: Connection, schema: str | None, table: str) -> dict[str, IndexDefinition | None]:
        rows = conn.execute(
            text(
                "SELECT index_name, non_unique, column_name, collation FROM information_schema.statistics "
                "WHERE table_schema = COALESCE(:schema, DATABASE()) AND table_name = :table "
                "ORDER BY index_name, seq_in_index"
            ),
            {"schema": schema, "table": table},
        )
        parts: dict[str, list[str]] = {}
        unique: dict[str, bool] = {}
        for name, non_unique, column, collation in rows:
            if name == "PRIMARY":
                continue
            unique[name] = not int(non_unique)
            parts.setdefault(name, []).append(f"{column} DESC" if collation == "D" else str(column))
        return {name: (unique[name], tuple(elements), None) for name, elements in parts.items()}

    def create(self, conn: Connection) -> None:
        """Tables first, then the indexes missing (MySQL has no ``CREATE INDEX IF NOT EXISTS``)."""
        for table in (self.jobs, self.dead, self.edges, self.batches, self.steps, self.events, self.sequences):
            table.create(conn, checkfirst=True)
            have = self._index_names_of(conn, table)
            for index in self.creatable_indexes(conn, table):
                if index.name not in have:
                    conn.execute(CreateIndex(index))

    @staticmethod
    def _index_names_of(conn: Connection, table: Table) -> set[str]:
        rows = conn.execute(
            text(
                "SELECT DISTINCT index_name FROM information_schema.statistics "
                "WHERE table_schema = COALESCE(:schema, DATABASE()) AND table_name = :table"
            ),
            {"schema": table.schema, "table": table.name},
        )
        return {r[0] for r in rows}

    def index_names(self, conn: Connection) -> set[str]:
        return self._index_names_of(conn, self.jobs)
