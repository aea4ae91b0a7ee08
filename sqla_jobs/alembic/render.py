"""How ``sqla_jobs.alembic`` renders what alembic gets wrong for the job tables (its ``render_item``).

The payload's internal type, the unique states' bitmask, the ``unique_held``
generated column, and a backend's own column types (PostgreSQL ``JSON``/``JSONB``,
for which alembic leaves out an import; MariaDB/MySQL's ``LONGTEXT`` JSON), which
its driver renders (``Driver.render_type``). Public through ``sqla_jobs.alembic``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._payload import PayloadType
from .._unique import StateSet
from ..drivers import GeneratedColumn, migration_guard, registered, stored_generated_dialects

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
        # Stored where a backend needs it to index the column (PostgreSQL), virtual elsewhere (SQLite can add
        # only those to a table): decided where the revision runs, so one revision serves every backend.
        prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
        return (f"{prefix}Computed({str(obj.sqltext)!r}, "
                f"persisted={migration_guard(stored_generated_dialects())} or None)")
    if type_ == "type":
        # A backend's own column type (jsonb, LONGTEXT for JSON): the driver says how to write it, and adds
        # the import it needs.
        prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
        for driver in registered():
            shown = driver.render_type(obj, autogen_context.imports, prefix)
            if shown is not None:
                return shown
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
