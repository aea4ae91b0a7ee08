"""Tables that live beside an app's jobs table: the dashboard's samples, the maintenance leader's lease.

Each is ``<jobs table>_<suffix>`` in the jobs table's schema. Declared in the
application's metadata (``samples_table(queue, Base.metadata)``,
``leader_table(queue, Base.metadata)``), it is one of the app's tables, for
``create_all`` and alembic autogenerate; undeclared, it lives in a metadata of
its own and its user creates it on first use, so the app's metadata is never
changed behind its back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sqlalchemy import MetaData, Table
from sqlalchemy.schema import SchemaItem

__all__ = ["HasJobModel", "companion_table"]


class HasJobModel(Protocol):
    """What a companion table needs of the app (a ``JobQueue``): typed without importing ``_app``, which
    imports the registry, which imports the limits, which make a companion table."""

    @property
    def job_model(self) -> type[Any]: ...

#: Companion tables not declared in an application's metadata, by table key.
_PRIVATE: dict[str, MetaData] = {}


def companion_table(
    queue: HasJobModel,
    suffix: str,
    metadata: MetaData | None,
    items: Callable[[str], Sequence[SchemaItem]],
) -> Table:
    """``<jobs table>_<suffix>``: the declared one if there is one, else made with ``items(name)``."""
    jobs: Table = queue.job_model.__table__
    name = f"{jobs.name}_{suffix}"
    key = f"{jobs.schema}.{name}" if jobs.schema else name
    # Declared: the table is (or becomes) the app's. Undeclared: the app's if it declared it, else our own.
    candidates = [metadata] if metadata is not None else [jobs.metadata, _PRIVATE.setdefault(key, MetaData())]
    for candidate in candidates:
        if key in candidate.tables:
            return candidate.tables[key]
    return Table(name, candidates[-1], *items(name), schema=jobs.schema)
