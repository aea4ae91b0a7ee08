"""The alembic helpers themselves: ``configure_options``, ``render_revision`` and the rest (the user doc is
``sqla_jobs.alembic``'s docstring)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from alembic.autogenerate import produce_migrations, render_python_code
from alembic.config import Config
from alembic.operations import ops
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, MetaData, inspect, make_url
from sqlalchemy.dialects import postgresql

from ..drivers import driver_class_of, migration_guard, migration_imports, normalise_url, registered, side_tables
from ..drivers.base import Driver, index_dialects
from ..errors import ConfigError
from .compare import (
    _leave_our_indexes_to_us,
    _server_defaults_of_job_tables,
    _with_our_indexes,
    job_tables,
    order_generated_columns,
    wrap_revision_directives,
)
from .render import RenderItem, render_item, wrap_render_item

if TYPE_CHECKING:
    from .._app import JobQueue

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

IncludeObject = Callable[[Any, "str | None", str, bool, Any], bool]
IncludeName = Callable[["str | None", str, dict[str, Any]], bool]


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
    result["process_revision_directives"] = wrap_revision_directives(options.get("process_revision_directives"))
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


# -- the render command ------------------------------------------------------------------


@dataclass(frozen=True)
class Rendered:
    """What ``render_revision`` did: the file written (None when there was nothing to do)."""

    path: Path | None
    revision: str | None
    down_revision: str | None
    summary: list[str]


def _job_metadata(queue: JobQueue[Any, Any], partitioned: bool = False) -> MetaData:
    """Copies of the app's tables: jobs (not when ``partitioned``: its own code makes it), dead letters, companions."""
    metadata = MetaData()
    for companion in side_tables(queue.job_model.__table__):  # type: ignore[attr-defined]
        companion.to_metadata(metadata)
    for model in (queue.dead_model,) if partitioned else (queue.job_model, queue.dead_model):
        original = model.__table__  # type: ignore[attr-defined]
        copy = original.to_metadata(metadata)
        # to_metadata drops Index.ddl_if: give each per-database index its dialects back.
        def key(ix: Any) -> tuple[str, ...]:
            # The WHERE tells apart two variants of one index on the same columns (partial or not).
            where = ix.dialect_kwargs.get("postgresql_where")
            return (str(ix.name), str(where), *(str(getattr(e, "name", None) or e) for e in ix.expressions))

        rules = {key(ix): index_dialects(ix) for ix in original.indexes}
        for index in copy.indexes:
            names = rules.get(key(index))
            if names is not None:
                index.ddl_if(dialect=names)
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


def _migration_ops(queue: JobQueue[Any, Any], conn: Connection | None,
                   partitioned: bool = False) -> tuple[ops.UpgradeOps, ops.DowngradeOps]:
    metadata = _job_metadata(queue, partitioned)
    if conn is None:
        # No database to compare with: create everything, as on an empty database.
        upgrade: list[ops.MigrateOperation] = []
        for table in metadata.sorted_tables:
            upgrade.append(ops.CreateTableOp.from_table(table))
            # An index the index rules build on some databases only is written by _guarded_indexes.
            everywhere = [ix for ix in table.indexes if index_dialects(ix) is None]
            indexes = [ops.CreateIndexOp.from_index(ix) for ix in sorted(everywhere, key=lambda i: i.name or "")]
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
    order_generated_columns(script.upgrade_ops)
    order_generated_columns(script.downgrade_ops)
    if not script.upgrade_ops.is_empty():
        script.upgrade_ops.ops[:0] = _create_schemas(metadata, conn)
    return script.upgrade_ops, script.downgrade_ops


def _guarded_indexes(queue: JobQueue[Any, Any], partitioned: bool = False) -> str:
    """Upgrade code for the indexes built on some databases only, each under a check of the dialect
    it runs on, so a revision rendered without a database serves every backend (the table's drop
    removes them on downgrade)."""
    code = []
    for table in _job_metadata(queue, partitioned).sorted_tables:
        for index in sorted(table.indexes, key=lambda i: (i.name or "", str(index_dialects(i)))):
            names = index_dialects(index)
            if names is None:
                continue
            rendered = render_python_code(ops.UpgradeOps([ops.CreateIndexOp.from_index(index)]),
                                          render_item=render_item)
            body = [line.strip() for line in rendered.splitlines() if line.strip() and not line.strip().startswith("#")]
            code.append(f"    if {migration_guard(names)}:\n" + "".join(f"        {b}\n" for b in body))
    return "".join(code).rstrip("\n")


def _create_schemas(metadata: MetaData, conn: Connection | None) -> list[ops.MigrateOperation]:
    """PostgreSQL schemas the tables live in, created if missing (and never dropped: they may hold more)."""
    if conn is not None and not driver_class_of(conn).creates_schemas():
        return []
    schemas = sorted({t.schema for t in metadata.tables.values() if t.schema})
    if conn is not None:
        existing = set(inspect(conn).get_schema_names())
        schemas = [s for s in schemas if s not in existing]
    preparer = postgresql.dialect().identifier_preparer
    return [ops.ExecuteSQLOp(f"CREATE SCHEMA IF NOT EXISTS {preparer.quote_schema(s)}") for s in schemas]


def _backends(conn: Connection | None) -> list[type[Driver]]:
    """The backend a revision rendered against ``conn`` is for, or, without a database, every registered one
    (the code each writes checks the dialect when it runs, so one revision serves them all)."""
    return [driver_class_of(conn)] if conn is not None else list(registered())


def _notify_trigger_code(queue: JobQueue[Any, Any], conn: Connection | None) -> tuple[str, str, list[str]] | None:
    """Upgrade and downgrade code for the wake-up trigger(s), if the database lacks them, and their summary.

    Autogenerate cannot see triggers, so render writes them; the code checks the
    dialect when it runs, so one revision still serves every backend.
    """
    table = queue.job_model.__table__  # type: ignore[attr-defined]
    if conn is not None and queue.driver(conn).has_notify_trigger(conn):
        return None
    codes = [code for code in (d.wake_trigger_migration(table) for d in _backends(conn)) if code is not None]
    if not codes:
        return None
    return "\n".join(c[0] for c in codes), "\n".join(c[1] for c in codes), [c[2] for c in codes]


def _partitioned_code(queue: JobQueue[Any, Any], conn: Connection | None) -> tuple[str, str, str]:
    """The backend's code creating the jobs table partitioned; ConfigError where it cannot be."""
    table = queue.job_model.__table__  # type: ignore[attr-defined]
    drivers = _backends(conn)
    codes = [code for code in (d.partitioned_migration(table) for d in drivers) if code is not None]
    if not codes:
        raise ConfigError(f"--partitioned: {drivers[0].label} has no partitioned mode (it is PostgreSQL's)")
    if conn is not None and inspect(conn).has_table(table.name, schema=table.schema):
        raise ConfigError(f"--partitioned: table {table.fullname!r} exists already; partitioning it is a data "
                          "migration of its own (see docs/howto/partitioning.md)")
    return codes[0]


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
    partitioned: bool = False,
) -> Rendered:
    """Write a revision for ``queue``'s tables into the project of ``alembic_ini``.

    With ``connection``, only what that database lacks (or has different) is
    rendered; nothing is written when it is already up to date. Without, the
    revision creates both tables. The revision goes on top of the current
    head and uses the project's own ``script.py.mako``. ``partitioned``: it
    creates the jobs table partitioned (PostgreSQL; docs/howto/partitioning.md),
    and ``connection`` only makes sure there is no jobs table yet.
    """
    ini = Path(alembic_ini)
    if not ini.is_file():
        raise ConfigError(
            f"no alembic config at {str(ini)!r}: pass --alembic-ini PATH, or start a project with "
            "`sqla-jobs migrations init migrations`"
        )
    # quiet: alembic would print its own "Generating ... done" line beside the caller's summary.
    config = Config(str(ini), cmd_opts=argparse.Namespace(quiet=True))
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
    jobs_code = _partitioned_code(queue, connection) if partitioned else None
    if partitioned:
        connection = None  # the dead-letter table is created too
    if connection is None:
        _refuse_second_create(queue, script_dir)
    upgrade, downgrade = _migration_ops(queue, connection, partitioned)
    summary = [jobs_code[2]] if jobs_code else []
    summary += [line for op in upgrade.ops for line in _describe(op)]
    if connection is None:  # the per-database indexes _guarded_indexes writes, named like the others
        summary.extend(sorted({f"create index {ix.name}" for t in _job_metadata(queue, partitioned).sorted_tables
                               for ix in t.indexes if index_dialects(ix) is not None}))
    trigger = _notify_trigger_code(queue, connection)
    if trigger is not None:
        summary.extend(trigger[2])
    if upgrade.is_empty() and trigger is None:
        return Rendered(None, None, head, [])
    # The models' types name every backend's variants, whatever the database at hand.
    imports = migration_imports()
    context = (
        MigrationContext.configure(connection=connection) if connection is not None else None
    )
    kwargs: dict[str, Any] = {"render_item": render_item, "imports": imports, "migration_context": context}
    upgrades = render_python_code(upgrade, **kwargs) if not upgrade.is_empty() else ""
    if connection is None:
        upgrades = f"{upgrades}\n{_guarded_indexes(queue, partitioned)}"
    downgrades = render_python_code(downgrade, **kwargs) if not downgrade.is_empty() else ""
    if jobs_code:  # first up, last down (the template indents the first line of each itself)
        upgrades, downgrades = f"{jobs_code[0].lstrip()}\n    {upgrades}", f"{downgrades}\n{jobs_code[1]}"
    if trigger is not None:
        # The revision template indents the first line itself; every other line carries its own indent.
        upgrades = f"{upgrades}\n{trigger[0]}" if upgrades else trigger[0].lstrip()
        downgrades = trigger[1].lstrip() + (f"\n    {downgrades}" if downgrades else "")
    job_table = queue.job_model.__table__  # type: ignore[attr-defined]
    if any(isinstance(op, ops.CreateTableOp) and op.table_name == job_table.name for op in upgrade.ops):
        # The revision creates the (plain) jobs table: the backends' settings for it follow.
        codes = (d.table_settings_migration(job_table) for d in _backends(connection))
        upgrades += "".join(f"\n{code}" for code in codes if code)
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
    url = normalise_url(make_url(raw))
    return url.render_as_string(hide_password=False)


def app_metadata(config: Config) -> MetaData | None:
    """The MetaData of the JobQueue named by ``SQLA_JOBS_APP`` or ``sqla_jobs.app`` in alembic.ini."""
    spec = os.environ.get("SQLA_JOBS_APP") or config.get_main_option("sqla_jobs.app")
    if not spec:
        return None
    from .._bootstrap import load_app  # the CLI's loader: the same one-line errors

    return load_app(spec).job_model.metadata  # type: ignore[no-any-return]


def template_dir() -> Path:
    """The folder of the ``alembic init`` template, wherever the package is installed."""
    spec = importlib.util.find_spec("sqla_jobs.alembic_templates")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the sqla-jobs alembic templates are missing from this installation; reinstall sqla-jobs")
    return Path(next(iter(spec.submodule_search_locations))) / "sqla_jobs"
