"""How ``sqla_jobs.alembic`` compares sqla-jobs' own indexes and defaults (its ``configure_options``).

alembic misjudges the job tables' partial and expression indexes, so they are
taken out of its comparison (``include_object``) and compared here: existence,
columns with their order, ``WHERE`` predicate, each backend's indexes read by
its driver (``Driver.reflect_indexes``). Importing this module registers the
comparator with alembic.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from alembic.autogenerate import comparators
from alembic.operations import ops
from sqlalchemy import Column, Computed, Index, Table, event, text

from .._models import DeadJobMixin, JobMixin
from ..drivers import GeneratedColumn, driver_class_of, registered

if TYPE_CHECKING:
    from alembic.autogenerate.api import AutogenContext

IncludeObject = Callable[[Any, "str | None", str, bool, Any], bool]


def job_tables() -> Iterator[tuple[Table, set[str]]]:
    """Each mapped JobMixin / DeadJobMixin table imported so far, with the names of sqla-jobs' indexes on it."""
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
                names = {ix.name for ix in indexes if isinstance(ix.name, str)}
                if issubclass(sub, JobMixin):  # and those a backend's layout adds (a partitioned table's)
                    names.update(*(d.layout_indexes(table.name) for d in registered()))
                yield table, names


def _our_index_names(table: Table) -> set[str]:
    """sqla-jobs' own index names on ``table`` (matched by schema and name), or none."""
    for job_table, names in job_tables():
        if job_table.name == table.name and job_table.schema == table.schema:
            return names
    return set()


def _leave_our_indexes_to_us(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """include_object: alembic misjudges sqla-jobs' partial and expression indexes; our comparator owns them.
    The tables a backend's layout adds to a jobs table (a partitioned table's partitions) are left alone."""
    if type_ == "table" and reflected and compare_to is None and name is not None:
        return not any(d.layout_table(t.name, name) for t, _ in job_tables() if t.schema == obj.schema
                       for d in registered())
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
            if isinstance(metadata_column.server_default, GeneratedColumn):
                return False  # a generated column cannot be altered; its expression is ours (see _generated_as_default)
            inspected, rendered = defaults[0], defaults[-1] if defaults else None
            if _is_null_default(rendered):  # "DEFAULT NULL": PostgreSQL reflects it as no default
                return not (inspected is None or _is_null_default(inspected))
            if _as_bool(rendered) is not None and _as_bool(inspected) is not None:
                return _as_bool(rendered) != _as_bool(inspected)  # "false" comes back as 0 where BOOLEAN is TINYINT
            return None
        if callable(yours):
            return yours(context, inspected_column, metadata_column, *defaults)  # type: ignore[no-any-return]
        return None if yours else False

    return compare


def _is_null_default(sql: Any) -> bool:
    # Our nullable columns say DEFAULT NULL (see models._NULL); it comes back as None, "NULL" or "NULL::text".
    text = sql.strip().strip("'").lower() if isinstance(sql, str) else ""
    return re.fullmatch(r"\(?'?null'?\)?(::[\w ]+)?", text) is not None


def _as_bool(sql: Any) -> bool | None:
    text = sql.strip().strip("()'").lower() if isinstance(sql, str) else ""
    return {"false": False, "0": False, "true": True, "1": True}.get(text)


def _normalise(sql: str) -> str:
    # PostgreSQL hands back "((state)::text = 'pending'::text)" for "state = 'pending'".
    sql = re.sub(r"::[\w ]+", "", sql.lower())
    sql = re.sub(r"\basc\b", "", sql)  # the default order; DESC matters and stays
    return re.sub(r"[\s()\"`\[\]]", "", sql)


def _metadata_signature(index: Index, dialect: str) -> Signature:
    columns = tuple(_normalise(str(getattr(e, "name", None) or e)) for e in index.expressions)
    where = index.dialect_kwargs.get(f"{dialect}_where")
    return bool(index.unique), columns, _normalise(str(where)) if where is not None else None


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
    driver = driver_class_of(autogen_context.dialect)
    dialect = driver.name
    have: dict[str, _FoundIndex | None] = {}
    if conn_table is not None and autogen_context.connection is not None:
        found = driver.reflect_indexes(autogen_context.connection, schema, tname)
        have = {name: None if d is None else _FoundIndex(*d) for name, d in found.items()}
        driver.check_reflected_table(autogen_context.connection, schema, metadata_table)
    for index in sorted(metadata_table.indexes, key=lambda ix: str(ix.name)):
        if index.name not in ours or not driver.applies(index):  # the index rules' variant for another database
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


@event.listens_for(Table, "column_reflect")
def _generated_as_default(inspector: Any, table: Table, column_info: dict[str, Any]) -> None:
    """A job table's generated column, reflected, reads as a plain server default.

    alembic (1.20) fails comparing a reflected generated column when
    ``compare_server_default`` is a callable, as ours is; handed over as a
    default, it reaches our comparison, which leaves it alone (it cannot be altered).
    """
    if column_info.get("computed") and column_info["name"] == "unique_held" and _our_index_names(table):
        computed = column_info.pop("computed")
        column_info["default"] = str(computed.get("sqltext"))


def _is_generated(op: Any) -> bool:
    column = getattr(op, "column", None)
    return isinstance(getattr(column, "server_default", None), Computed)


def order_generated_columns(container: Any) -> None:
    """Add generated columns after the columns they read, and drop them first.

    alembic orders the columns it adds to an existing table as a set does, and
    ``unique_held`` reads ``unique_key`` and ``unique_states``: PostgreSQL and
    SQLite refuse a generated column over a column not there yet, or dropping
    a column a generated one reads.
    """
    for op in list(getattr(container, "ops", [])):
        if isinstance(op, (ops.ModifyTableOps, ops.UpgradeOps, ops.DowngradeOps)):
            order_generated_columns(op)
    if not isinstance(container, ops.ModifyTableOps):
        return
    adds = [op for op in container.ops if isinstance(op, ops.AddColumnOp)]
    if any(_is_generated(op) for op in adds):
        others = [op for op in container.ops if not isinstance(op, ops.AddColumnOp)]
        at = container.ops.index(adds[0])
        ordered = [op for op in adds if not _is_generated(op)] + [op for op in adds if _is_generated(op)]
        container.ops = [op for op in others if container.ops.index(op) < at] + ordered + [
            op for op in others if container.ops.index(op) > at]
    drops = [op for op in container.ops if isinstance(op, ops.DropColumnOp)]
    generated = [op for op in drops if _is_generated(op.to_column()) or _reads_as_generated(op)]
    if generated:
        rest = [op for op in container.ops if op not in generated]
        first = next(i for i, op in enumerate(rest) if isinstance(op, ops.DropColumnOp))
        container.ops = rest[:first] + generated + rest[first:]


def _reads_as_generated(op: Any) -> bool:
    # A drop's reverse (the column as reflected) may carry the generated column as a plain default.
    return bool(getattr(op, "column_name", None) == "unique_held")


def wrap_revision_directives(yours: Any) -> Callable[..., None]:
    """``process_revision_directives``: yours first, then ``order_generated_columns`` on each script."""

    def process(context: Any, revision: Any, directives: list[Any]) -> None:
        if yours is not None:
            yours(context, revision, directives)
        for script in directives:
            for container in (*getattr(script, "upgrade_ops_list", []), *getattr(script, "downgrade_ops_list", [])):
                order_generated_columns(container)

    return process


# alembic calls every registered "table" comparator for every table; ours acts on job tables only.
comparators.dispatch_for("table")(_compare_job_index_lists)
# alembic warns that it skips (or guesses at) the claim index on SQLite; the comparator above owns it.
warnings.filterwarnings(
    "ignore", message=r"autogenerate skipping metadata-specified expression-based index 'ix_\w+_pending'"
)


def _not_about_our_claim_index(record: logging.LogRecord) -> bool:
    return not re.match(r"Generating approximate signature for index Index\('ix_\w+_pending'", record.getMessage())


logging.getLogger("alembic.ddl.impl").addFilter(_not_about_our_claim_index)
