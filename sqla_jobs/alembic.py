"""Keep the job tables in your own alembic history.

Install the extra (``pip install "sqla-jobs[alembic]"``); importing
``sqla_jobs`` alone never imports alembic.

Autogenerate
------------

Your models already include ``JobMixin`` / ``DeadJobMixin`` classes, so
``alembic revision --autogenerate`` sees the job tables. Left alone, alembic
writes a revision that does not run or is incomplete: it renders the
PostgreSQL ``JSONB`` variant as ``postgresql.JSONB(astext_type=Text())``
without importing ``Text`` (``NameError`` on upgrade), on SQLite it leaves out
the claim index ``ix_<table>_pending`` (an expression index) and then reports
it as changed forever, and it never notices a changed partial-index
predicate. Add our options to both ``context.configure(...)`` calls in your
``env.py``::

    from sqla_jobs.alembic import configure_options

    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        **configure_options(target_metadata),
    )

This adds a ``render_item`` for the JSONB types, takes the queue's own
indexes away from alembic's index comparison (``include_object``) and
compares them itself (existence, columns with their order, ``WHERE``
predicate), compares the job tables' server defaults, and, when your tables live in named PostgreSQL schemas, looks into
those schemas only. If you already have a ``render_item``, ``include_object``
or ``include_name`` of your own, hand them over and they are still called
first::

    **configure_options(target_metadata, render_item=my_render_item, include_object=my_filter)

After ``alembic upgrade head``, ``alembic check`` reports no difference on
PostgreSQL and SQLite. ``render_item`` (a drop-in ``render_item`` callable)
and ``wrap_render_item(yours)`` are also available on their own.

Rendered revision
-----------------

``sqla-jobs migrations render --app myapp.jobs:queue`` writes a revision into
your versions folder (``--alembic-ini``, default ``./alembic.ini``) whose
``down_revision`` is your current head: without a database it creates both
tables and their indexes; with ``--url`` (or ``SQLA_JOBS_URL``) it compares
the database with this version's models and renders exactly the difference,
which is how you upgrade the schema after upgrading sqla-jobs. See
``render_revision``.

New project
-----------

``sqla-jobs migrations init DIR`` runs ``alembic init`` with our template: an
``env.py`` that already uses ``configure_options`` and reads the database URL
from ``SQLA_JOBS_URL`` when set. ``sqla-jobs migrations template-path``
prints the template's folder for ``alembic init -t PATH DIR``. Its ``env.py``
finds your models through ``sqla_jobs.app`` in ``alembic.ini`` (or
``SQLA_JOBS_APP``) until you point ``target_metadata`` at your own ``Base``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alembic.autogenerate import comparators, produce_migrations, render_python_code
from alembic.config import Config
from alembic.operations import ops
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Column, Connection, Index, MetaData, Table, inspect, make_url, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSON as PG_JSON
from sqlalchemy.dialects.postgresql import JSONB

from ._payload import PayloadType
from .errors import ConfigError
from .models import DeadJobMixin, JobMixin
from .sql import notify_trigger_ddl, notify_trigger_name

if TYPE_CHECKING:
    from alembic.autogenerate.api import AutogenContext

    from .queue import JobQueue

__all__ = [
    "Rendered",
    "app_metadata",
    "configure_options",
    "database_url",
    "job_tables",
    "render_item",
    "render_revision",
    "template_dir",
    "wrap_render_item",
]

log = logging.getLogger(__name__)

RenderItem = Callable[[str, Any, "AutogenContext"], "str | bool"]
IncludeObject = Callable[[Any, "str | None", str, bool, Any], bool]
IncludeName = Callable[["str | None", str, dict[str, Any]], bool]


# -- rendering -------------------------------------------------------------------


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Render what alembic gets wrong for the job tables; ``False`` means "alembic's default".

    PostgreSQL ``JSON``/``JSONB`` types (alone or as a variant) are rendered
    with ``sa.Text()`` for their ``astext_type`` and the import they need, so
    the revision runs no matter which database it was generated against.
    """
    if type_ == "type" and isinstance(obj, PayloadType):
        # The payload column's type is internal; to the database it is JSON (jsonb on PostgreSQL).
        prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
        rendered = f"{prefix}{obj.impl_instance!r}"
        for dialect, variant in sorted(getattr(obj, "_variant_mapping", {}).items()):
            inner = variant.impl_instance if isinstance(variant, PayloadType) else variant
            shown = render_item("type", inner, autogen_context)
            rendered += f".with_variant({shown if shown is not False else prefix + repr(inner)}, {dialect!r})"
        return rendered
    if type_ == "type" and isinstance(obj, (JSONB, PG_JSON)):
        autogen_context.imports.add("from sqlalchemy.dialects import postgresql")
        prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
        # repr is e.g. "JSONB(astext_type=Text())"; Text is only importable via sa.
        return "postgresql." + repr(obj).replace("astext_type=Text(", f"astext_type={prefix}Text(")
    return False


def wrap_render_item(yours: RenderItem | None) -> RenderItem:
    """A ``render_item`` that asks ``yours`` first, then ours, then alembic's default."""
    if yours is None:
        return render_item

    def combined(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
        rendered = yours(type_, obj, autogen_context)
        if rendered is not False:
            return rendered
        return render_item(type_, obj, autogen_context)

    return combined


def configure_options(
    metadata: MetaData | None = None,
    *,
    render_item: RenderItem | None = None,
    include_object: IncludeObject | None = None,
    include_name: IncludeName | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``context.configure(...)`` in ``env.py``.

    ``render_item``, ``include_object`` and ``include_name`` are yours, kept
    and called first; other ``options`` pass through unchanged (a
    ``compare_server_default`` of yours applies to your other tables; the job
    tables' server defaults are always compared). When
    ``metadata`` (your ``target_metadata``) has tables in named schemas,
    autogenerate looks into those schemas and no others (``include_schemas``
    plus a schema filter), so it never proposes to drop tables of schemas your
    models do not describe. ``compare_type`` is on so a changed column type
    shows up in ``alembic check``.
    """
    result: dict[str, Any] = {"compare_type": True, **options, "render_item": wrap_render_item(render_item)}
    result["include_object"] = _with_our_indexes(include_object)
    result["compare_server_default"] = _server_defaults_of_job_tables(options.get("compare_server_default", False))
    schemas = {t.schema for t in metadata.tables.values()} if metadata is not None else set()
    named = {s for s in schemas if s is not None}
    if named:
        result.setdefault("include_schemas", True)

        def only_our_schemas(name: str | None, type_: str, parent: dict[str, Any]) -> bool:
            if include_name is not None and not include_name(name, type_, parent):
                return False
            # None is the connection's default schema (the search_path's first).
            return type_ != "schema" or name is None or name in named

        result["include_name"] = only_our_schemas
    elif include_name is not None:
        result["include_name"] = include_name
    return result


# -- comparison --------------------------------------------------------------------


def job_tables() -> Iterator[tuple[Table, set[str]]]:
    """Each mapped JobMixin / DeadJobMixin table imported so far, with the names of the queue's indexes on it."""
    seen: set[type] = set()
    stack: list[type] = [JobMixin, DeadJobMixin]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub in seen:
                continue
            seen.add(sub)
            stack.append(sub)
            table = sub.__dict__.get("__table__")
            if isinstance(table, Table):
                indexes = sub.job_indexes() if issubclass(sub, JobMixin) else sub.dead_indexes()
                yield table, {ix.name for ix in indexes if isinstance(ix.name, str)}


def _our_index_names(table: Table) -> set[str]:
    """The queue's own index names on ``table`` (matched by schema and name), or none."""
    for job_table, names in job_tables():
        if job_table.name == table.name and job_table.schema == table.schema:
            return names
    return set()


def _leave_our_indexes_to_us(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """include_object: alembic misjudges the queue's partial and expression indexes; our comparator owns them."""
    return not (type_ == "index" and name in _our_index_names(obj.table))


def _with_our_indexes(yours: IncludeObject | None) -> IncludeObject:
    if yours is None:
        return _leave_our_indexes_to_us

    def combined(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        return yours(obj, name, type_, reflected, compare_to) and _leave_our_indexes_to_us(
            obj, name, type_, reflected, compare_to
        )

    return combined


Signature = tuple[bool, tuple[str, ...], "str | None"]  # unique, columns (with DESC), predicate


@dataclass(frozen=True)
class _FoundIndex:
    """An index as the database has it: column elements (``"priority DESC"``) and predicate, as SQL text."""

    unique: bool
    elements: tuple[str, ...]
    where: str | None

    def signature(self) -> Signature:
        return self.unique, tuple(_normalise(e) for e in self.elements), _normalise(self.where) if self.where else None

    def as_index(self, name: str, table: Table, dialect: str) -> Index | None:
        """This definition as an Index on the reflected ``table``, so a downgrade can re-create it."""
        parts: list[Any] = []
        for element in self.elements:
            column = element.strip().strip('"`[]')
            parts.append(table.c[column] if column in table.c else text(element.strip()))
        if not any(isinstance(p, Column) for p in parts):
            return None  # no plain column to tie it to the table
        options = {f"{dialect}_where": text(self.where)} if self.where else {}
        return Index(name, *parts, unique=self.unique, **options)


def _server_defaults_of_job_tables(yours: Any) -> Callable[..., bool | None]:
    """compare_server_default: on for the job tables (None = alembic's comparison), yours for the rest."""

    def compare(context: Any, inspected_column: Any, metadata_column: Any, *defaults: Any) -> bool | None:
        table = metadata_column.table
        if _our_index_names(table):
            inspected, rendered = defaults[0], defaults[-1] if defaults else None
            if _is_null_default(rendered):  # "DEFAULT NULL": PostgreSQL reflects it as no default
                return not (inspected is None or _is_null_default(inspected))
            return None
        if callable(yours):
            return yours(context, inspected_column, metadata_column, *defaults)  # type: ignore[no-any-return]
        return None if yours else False

    return compare


def _is_null_default(sql: Any) -> bool:
    # Our nullable columns say DEFAULT NULL (see models._NULL); it comes back as None, "NULL" or "NULL::text".
    text = sql.strip().strip("'").lower() if isinstance(sql, str) else ""
    return re.fullmatch(r"\(?'?null'?\)?(::[\w ]+)?", text) is not None


def _normalise(sql: str) -> str:
    # PostgreSQL hands back "((state)::text = 'pending'::text)" for "state = 'pending'".
    sql = re.sub(r"::[\w ]+", "", sql.lower())
    sql = re.sub(r"\basc\b", "", sql)  # the default order; DESC matters and stays
    return re.sub(r"[\s()\"`\[\]]", "", sql)


def _metadata_signature(index: Index, dialect: str) -> Signature:
    columns = tuple(_normalise(str(getattr(e, "name", None) or e)) for e in index.expressions)
    where = index.dialect_kwargs.get(f"{dialect}_where")
    return bool(index.unique), columns, _normalise(str(where)) if where is not None else None


def _postgresql_index(index: dict[str, Any]) -> _FoundIndex | None:
    expressions = index.get("expressions") or index.get("column_names") or []
    if any(e is None for e in expressions):
        return None  # an expression this SQLAlchemy version cannot reflect: only its existence is known
    sorting = index.get("column_sorting") or {}
    elements = tuple(f"{e} DESC" if "desc" in sorting.get(e, ()) else str(e) for e in expressions)
    where = (index.get("dialect_options") or {}).get("postgresql_where")
    return _FoundIndex(bool(index.get("unique")), elements, str(where) if where is not None else None)


def _sqlite_index(sql: str) -> _FoundIndex | None:
    """Parse SQLite's own copy of ``CREATE INDEX``: reflection drops DESC (and, in some versions, more)."""
    head = re.match(r"\s*create\s+(unique\s+)?index\s.*?\son\s+[^(]+\(", sql, re.IGNORECASE | re.DOTALL)
    if head is None:
        return None
    depth, start = 1, head.end()
    for i in range(start, len(sql)):
        depth += {"(": 1, ")": -1}.get(sql[i], 0)
        if depth == 0:
            break
    else:
        return None
    elements = tuple(e.strip() for e in sql[start:i].split(","))  # no commas inside our index elements
    rest = re.match(r"\s*where\s+(.*?)\s*$", sql[i + 1 :], re.IGNORECASE | re.DOTALL)
    return _FoundIndex(bool(head.group(1)), elements, rest.group(1) if rest else None)


def _compare_job_index_lists(
    autogen_context: AutogenContext,
    modify_ops: ops.ModifyTableOps,
    schema: str | None,
    tname: str,
    conn_table: Table | None,
    metadata_table: Table | None,
) -> None:
    if metadata_table is None or autogen_context.dialect is None:
        return
    ours = _our_index_names(metadata_table)
    if not ours:
        return
    dialect = autogen_context.dialect.name
    have: dict[str, _FoundIndex | None] = {}
    if conn_table is not None and dialect == "sqlite" and autogen_context.connection is not None:
        found_sql = _sqlite_indexes(autogen_context.connection, schema, tname)
        have = {name: _sqlite_index(sql) for name, sql in found_sql}
        _warn_if_autoincrement_lost(autogen_context.connection, schema, metadata_table)
    elif conn_table is not None:
        inspector = autogen_context.inspector
        have = {ix["name"]: _postgresql_index(dict(ix)) for ix in inspector.get_indexes(tname, schema=schema)}
    for index in sorted(metadata_table.indexes, key=lambda ix: str(ix.name)):
        if index.name not in ours:
            continue
        if index.name not in have:
            modify_ops.ops.append(ops.CreateIndexOp.from_index(index))
            continue
        found = have[index.name]
        if found is not None and found.signature() != _metadata_signature(index, dialect):
            # Different columns, order or predicate: rebuild it; the downgrade puts the old one back.
            assert conn_table is not None and isinstance(index.name, str)
            old = found.as_index(index.name, conn_table, dialect) or index
            modify_ops.ops.append(ops.DropIndexOp.from_index(old))
            modify_ops.ops.append(ops.CreateIndexOp.from_index(index))


def _warn_if_autoincrement_lost(conn: Connection, schema: str | None, table: Table) -> None:
    """alembic's SQLite batch mode rebuilds a table without AUTOINCREMENT; it has no operation to restore it."""
    if not table.dialect_options["sqlite"].get("autoincrement"):
        return
    master = f'"{schema}".sqlite_master' if schema else "sqlite_master"
    sql = conn.execute(text(f"SELECT sql FROM {master} WHERE type = 'table' AND name = :t"), {"t": table.name})
    created = sql.scalar() or ""
    if "autoincrement" not in created.lower():
        log.warning(
            "table %s was created without AUTOINCREMENT (alembic's batch mode drops it when it rebuilds a table): "
            "SQLite may reuse the id of a job that left the table, so requeueing its dead-letter copy can fail; "
            "rebuild it with op.batch_alter_table(%r, recreate='always', table_kwargs={'sqlite_autoincrement': True})",
            table.name,
            table.name,
        )


def _sqlite_indexes(conn: Connection, schema: str | None, table: str) -> list[tuple[str, str]]:
    master = f'"{schema}".sqlite_master' if schema else "sqlite_master"
    query = text(f"SELECT name, sql FROM {master} WHERE type = 'index' AND tbl_name = :t AND sql IS NOT NULL")
    return [(r[0], r[1]) for r in conn.execute(query, {"t": table})]


# alembic calls every registered "table" comparator for every table; ours acts on job tables only.
comparators.dispatch_for("table")(_compare_job_index_lists)
# alembic warns that it skips (or guesses at) the claim index on SQLite; the comparator above owns it.
warnings.filterwarnings(
    "ignore", message=r"autogenerate skipping metadata-specified expression-based index 'ix_\w+_pending'"
)


def _not_about_our_claim_index(record: logging.LogRecord) -> bool:
    return not re.match(r"Generating approximate signature for index Index\('ix_\w+_pending'", record.getMessage())


logging.getLogger("alembic.ddl.impl").addFilter(_not_about_our_claim_index)


# -- the render command ------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    """What ``render_revision`` did: the file written (None when there was nothing to do)."""

    path: Path | None
    revision: str | None
    down_revision: str | None
    summary: list[str]


def _job_metadata(queue: JobQueue[Any, Any]) -> MetaData:
    """A MetaData holding copies of just the queue's two tables (not the rest of the app)."""
    metadata = MetaData()
    for model in (queue.job_model, queue.dead_model):
        model.__table__.to_metadata(metadata)  # type: ignore[attr-defined]
    return metadata


def _describe(op: ops.MigrateOperation) -> Iterator[str]:
    if isinstance(op, ops.ModifyTableOps):
        for sub in op.ops:
            yield from _describe(sub)
    elif isinstance(op, ops.CreateTableOp):
        yield f"create table {op.table_name}"
    elif isinstance(op, ops.AddColumnOp):
        yield f"add column {op.table_name}.{op.column.name}"
    elif isinstance(op, ops.CreateIndexOp):
        yield f"create index {op.index_name}"
    elif isinstance(op, ops.DropIndexOp):
        yield f"drop index {op.index_name}"
    elif isinstance(op, ops.AlterColumnOp):
        yield f"alter column {op.table_name}.{op.column_name}"
    elif isinstance(op, ops.ExecuteSQLOp):
        yield str(op.sqltext)
    else:
        yield type(op).__name__


def _migration_ops(queue: JobQueue[Any, Any], conn: Connection | None) -> tuple[ops.UpgradeOps, ops.DowngradeOps]:
    metadata = _job_metadata(queue)
    if conn is None:
        # No database to compare with: create everything, as on an empty database.
        upgrade: list[ops.MigrateOperation] = []
        for table in metadata.sorted_tables:
            upgrade.append(ops.CreateTableOp.from_table(table))
            indexes = [ops.CreateIndexOp.from_index(ix) for ix in sorted(table.indexes, key=lambda i: i.name or "")]
            upgrade.append(ops.ModifyTableOps(table.name, indexes, schema=table.schema))  # type: ignore[arg-type]
        down = ops.UpgradeOps(upgrade).reverse()
        return ops.UpgradeOps([*_create_schemas(metadata, None), *upgrade]), down
    names = {t.name for t in metadata.tables.values()}
    schemas = {t.schema for t in metadata.tables.values()}

    def include_name(name: str | None, type_: str, parent: dict[str, Any]) -> bool:
        if type_ == "schema":  # None is the connection's default schema
            return name in schemas or (name is None and conn.dialect.default_schema_name in schemas)
        if type_ == "table":
            return name in names
        return True

    context = MigrationContext.configure(
        connection=conn,
        opts={
            "target_metadata": metadata,
            "include_name": include_name,
            "include_object": _leave_our_indexes_to_us,
            "include_schemas": any(s is not None for s in schemas),
            "compare_type": True,
            "compare_server_default": _server_defaults_of_job_tables(False),
            "render_item": render_item,
        },
    )
    script = produce_migrations(context, metadata)
    assert script.upgrade_ops is not None and script.downgrade_ops is not None
    if not script.upgrade_ops.is_empty():
        script.upgrade_ops.ops[:0] = _create_schemas(metadata, conn)
    return script.upgrade_ops, script.downgrade_ops


def _create_schemas(metadata: MetaData, conn: Connection | None) -> list[ops.MigrateOperation]:
    """PostgreSQL schemas the tables live in, created if missing (and never dropped: they may hold more)."""
    if conn is not None and conn.dialect.name != "postgresql":
        return []
    schemas = sorted({t.schema for t in metadata.tables.values() if t.schema})
    if conn is not None:
        existing = set(inspect(conn).get_schema_names())
        schemas = [s for s in schemas if s not in existing]
    preparer = postgresql.dialect().identifier_preparer
    return [ops.ExecuteSQLOp(f"CREATE SCHEMA IF NOT EXISTS {preparer.quote_schema(s)}") for s in schemas]


def _notify_trigger_code(queue: JobQueue[Any, Any], conn: Connection | None) -> tuple[str, str] | None:
    """Upgrade and downgrade code for the NOTIFY trigger, if the database lacks it.

    Autogenerate cannot see triggers, so render writes it; the code checks the
    dialect when it runs, so one revision still serves PostgreSQL and SQLite.
    """
    table = queue.job_model.__table__  # type: ignore[attr-defined]
    if conn is not None and (conn.dialect.name != "postgresql" or queue.sql(conn).has_notify_trigger(conn)):
        return None
    create, drop = notify_trigger_ddl(table)
    function, trigger = create.split(";\n")
    guard = '    if op.get_bind().dialect.name == "postgresql":\n'
    upgrade = (guard + "        # wakes idle workers at commit (LISTEN/NOTIFY); see sqla_jobs.sql.notify_trigger_ddl\n"
               f"        op.execute({function!r})\n        op.execute({trigger!r})")
    downgrade = guard + f"        op.execute({drop!r})"
    return upgrade, downgrade


def _refuse_second_create(queue: JobQueue[Any, Any], script_dir: ScriptDirectory) -> None:
    """A create-everything revision on top of a history that already creates the tables would fail on upgrade."""
    names = [m.__table__.name for m in (queue.job_model, queue.dead_model)]  # type: ignore[attr-defined]
    for script in script_dir.walk_revisions():
        source = Path(script.path).read_text(encoding="utf-8", errors="replace")
        for name in names:
            if re.search(rf"create_table\(\s*['\"]{re.escape(name)}['\"]", source):
                raise ConfigError(
                    f"revision {script.revision} ({Path(script.path).name}) already creates table {name!r}: "
                    "pass --url (or set SQLA_JOBS_URL) so render writes only what your database lacks"
                )


def render_revision(
    queue: JobQueue[Any, Any],
    alembic_ini: str | Path = "alembic.ini",
    *,
    connection: Connection | None = None,
    message: str | None = None,
) -> Rendered:
    """Write a revision for ``queue``'s tables into the project of ``alembic_ini``.

    With ``connection``, only what that database lacks (or has different) is
    rendered; nothing is written when it is already up to date. Without, the
    revision creates both tables. The revision goes on top of the current
    head and uses the project's own ``script.py.mako``.
    """
    ini = Path(alembic_ini)
    if not ini.is_file():
        raise ConfigError(
            f"no alembic config at {str(ini)!r}: pass --alembic-ini PATH, or start a project with "
            "`sqla-jobs migrations init migrations`"
        )
    config = Config(str(ini))
    try:
        script_dir = ScriptDirectory.from_config(config)
    except CommandError as exc:  # e.g. script_location missing or not a folder
        raise ConfigError(f"{ini}: {exc}") from None
    heads = script_dir.get_heads()
    if len(heads) > 1:
        raise ConfigError(
            f"the alembic history in {ini} has several heads ({', '.join(heads)}): "
            "merge them with `alembic merge heads` first"
        )
    head = heads[0] if heads else None
    if connection is None:
        _refuse_second_create(queue, script_dir)
    upgrade, downgrade = _migration_ops(queue, connection)
    summary = [line for op in upgrade.ops for line in _describe(op)]
    trigger = _notify_trigger_code(queue, connection)
    if trigger is not None:
        summary.append(f"create trigger {notify_trigger_name(queue.job_model.__table__)} (PostgreSQL)")  # type: ignore[attr-defined]
    if upgrade.is_empty() and trigger is None:
        return Rendered(None, None, head, [])
    imports = ("from sqlalchemy.dialects import postgresql",)
    context = (
        MigrationContext.configure(connection=connection) if connection is not None else None
    )
    kwargs: dict[str, Any] = {"render_item": render_item, "imports": imports, "migration_context": context}
    upgrades = render_python_code(upgrade, **kwargs) if not upgrade.is_empty() else ""
    downgrades = render_python_code(downgrade, **kwargs) if not downgrade.is_empty() else ""
    if trigger is not None:
        # The revision template indents the first line itself; every other line carries its own indent.
        upgrades = f"{upgrades}\n{trigger[0]}" if upgrades else trigger[0].lstrip()
        downgrades = trigger[1].lstrip() + (f"\n    {downgrades}" if downgrades else "")
    tables = ", ".join(m.__table__.fullname for m in (queue.job_model, queue.dead_model))  # type: ignore[attr-defined]
    if message is None:
        message = f"sqla-jobs tables {tables}" if connection is None else f"sqla-jobs schema upgrade of {tables}"
    rev_id = uuid.uuid4().hex[-12:]
    try:
        script = script_dir.generate_revision(
            rev_id,
            message,
            head="head" if head else None,
            upgrades=upgrades,
            downgrades=downgrades,
            imports="\n".join(imports),
        )
    except CommandError as exc:  # e.g. several version locations and no way to choose
        raise ConfigError(f"{ini}: {exc}") from None
    assert script is not None
    return Rendered(Path(script.path), script.revision, head, summary)


# -- helpers for env.py ------------------------------------------------------------------


def database_url(config: Config) -> str:
    """The URL to migrate: ``SQLA_JOBS_URL`` if set, else ``sqlalchemy.url`` from alembic.ini."""
    raw = os.environ.get("SQLA_JOBS_URL") or config.get_main_option("sqlalchemy.url")
    if not raw or "driver://" in raw:
        raise ConfigError(
            "no database to migrate: set sqlalchemy.url in alembic.ini or the SQLA_JOBS_URL environment variable"
        )
    url = make_url(raw)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")  # psycopg 3 is what sqla-jobs installs
    return url.render_as_string(hide_password=False)


def app_metadata(config: Config) -> MetaData | None:
    """The MetaData of the JobQueue named by ``SQLA_JOBS_APP`` or ``sqla_jobs.app`` in alembic.ini."""
    spec = os.environ.get("SQLA_JOBS_APP") or config.get_main_option("sqla_jobs.app")
    if not spec:
        return None
    from .cli import load_app  # the CLI's loader gives the same one-line errors

    return load_app(spec).job_model.metadata  # type: ignore[no-any-return]


def template_dir() -> Path:
    """The folder of the ``alembic init`` template, wherever the package is installed."""
    spec = importlib.util.find_spec("sqla_jobs.alembic_templates")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the sqla-jobs alembic templates are missing from this installation; reinstall sqla-jobs")
    return Path(next(iter(spec.submodule_search_locations))) / "sqla_jobs"
