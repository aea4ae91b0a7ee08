"""How ``sqla_jobs.alembic`` renders what alembic gets wrong for the job tables (its ``render_item``).

The payload's internal type, PostgreSQL ``JSON``/``JSONB`` (alembic leaves
out an import), MariaDB/MySQL's ``LONGTEXT`` JSON, the unique states' bitmask
and the ``unique_held`` generated column. Public through ``sqla_jobs.alembic``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy.dialects.postgresql import JSON as PG_JSON
from sqlalchemy.dialects.postgresql import JSONB

from .._payload import PayloadType
from .._unique import StateSet
from ..drivers import GeneratedColumn, JSONText

if TYPE_CHECKING:
    from alembic.autogenerate.api import AutogenContext

__all__ = ["RenderItem", "render_item", "wrap_render_item"]

RenderItem = Callable[[str, Any, "AutogenContext"], "str | bool"]


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
    if type_ == "type" and isinstance(obj, StateSet):
        # The unique states' bitmask (sqla_jobs._unique): a plain INTEGER to the database.
        return f"{autogen_context.opts.get('sqlalchemy_module_prefix') or ''}Integer()"
    if type_ == "server_default" and isinstance(obj, GeneratedColumn):
        # Stored on PostgreSQL (whose virtual columns cannot be indexed), virtual elsewhere (SQLite can add
        # only those to a table): decided where the revision runs, so one revision serves every backend.
        prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
        return (f"{prefix}Computed({str(obj.sqltext)!r}, "
                "persisted=op.get_bind().dialect.name == 'postgresql' or None)")
    if type_ == "type" and isinstance(obj, JSONText):
        # MariaDB/MySQL keep the job tables' JSON as LONGTEXT (drivers/mysql/driver.py); the revision needs only that.
        autogen_context.imports.add("from sqlalchemy.dialects import mysql")
        return "mysql.LONGTEXT()"
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
