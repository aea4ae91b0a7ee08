"""Database drivers: everything sqla-jobs does differently per database. Internal.

This package is not public API: its classes and methods change with the
package's needs, without deprecation. Applications use ``JobQueue``, ``Worker``
and the CLI; those ask :func:`driver_for` for the driver of their database and
never branch on a dialect name themselves (``tests/test_structure.py`` checks).

A driver is one module that subclasses :class:`~sqla_jobs.drivers.base.Driver`
and registers itself below. ``base.py`` (and ``_operations.py``) hold the
statements every backend shares, as portable SQLAlchemy Core. A new backend
must implement:

* the database clock: ``now``, ``later``, ``seconds_between``;
* ``claim_batch``: take up to N due jobs in (priority desc, run_at, id) order without
  two workers ever getting the same job, and return them in that order,
  with the isolation rule (``alone``) and whether an isolated job waits, leaving out
  ``skip_kinds`` (the kinds with limits, which ``_limits.claim_limited`` claims);
  optionally ``finish_and_claim`` fused into one round trip;
* ``json_field_text``: a payload field as text, for per-key limits (``_limits.payload_key``);
* ``dialects`` (if not just ``name``), ``partial_indexes``, ``stores_generated_columns``, and where the
  portable column types will not do ``column_type`` / ``table_options`` / ``render_type`` /
  ``migration_imports``: the job tables as the backend stores them (``_models`` and the alembic
  helpers ask the functions below, which ask every registered backend);
* ``errors_plus``: append one entry to the JSON ``errors`` column in SQL;
* ``run_times``: count, mean, p50, p95, max of run times per kind;
* ``reflect_indexes`` for the alembic comparator, and ``bench_scratch`` for
  ``sqla-jobs bench``;

and may override, where the database offers more: ``begin_write`` (take the
write lock up front), ``skip_locked`` (pass over locked rows), ``prune_lock``,
``insert_many`` (a bulk protocol; ``supports_copy``), ``notify`` /
``has_notify_trigger`` / ``channel`` / ``attach_table_events`` /
``wake_trigger_migration`` / ``listener`` / ``async_listener`` (wake-ups; ``supports_listen``), ``harden``
(keepalives), ``normalise_url`` (the DBAPI driver sqla-jobs ships),
``hot_isolation``, ``create``, ``prepare``, ``index_names``,
``create_partitioned`` / ``partitioned_migration`` / ``upkeep`` / ``layout_indexes`` /
``layout_table`` (a table layout of its own: PostgreSQL's partitioned mode, ``pg_partitions.py``),
``claim_capped`` / ``finish_and_claim_capped`` (the claim of plain running limits in fewer round
trips: PostgreSQL's ``pg_limits.py``);
and, where the database has no ``UPDATE … RETURNING`` (MariaDB/MySQL), the
writes the base class does with it: ``finish``, ``heartbeat``,
``dead_letter``, ``requeue_dead``, ``prune_batch``. A driver that writes its own
``finish`` or fused ``finish_and_claim`` deletes the jobs instead of marking them
finished when ``discard_finished`` is set (a worker with ``prune_after=0``).

A backend is done when ``tests/drivers/`` (the conformance suite) passes
unchanged with its name added to the backend list in ``tests/conftest.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, Table, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, NoSuchModuleError
from sqlalchemy.types import TypeEngine

from ..errors import ConfigError
from ._batches import CALLBACK_POLICIES, ERRBACK, batch_table
from ._durable import event_table, step_table
from ._graph import FAILURE_POLICIES, edge_table
from ._sequences import MAX_SEQUENCE_KEY_LENGTH, SEQUENCE_POSITION, sequence_table
from ._setup import GeneratedColumn
from .base import DatabaseNow, Driver
from .mysql import JSONText, MySQLDriver
from .postgresql.driver import PostgreSQLDriver
from .sqlite import SQLiteDriver

__all__ = [
    "CALLBACK_POLICIES",
    "ERRBACK",
    "FAILURE_POLICIES",
    "MAX_SEQUENCE_KEY_LENGTH",
    "SEQUENCE_POSITION",
    "DatabaseNow",
    "Driver",
    "GeneratedColumn",
    "JSONText",
    "attach_table_events",
    "batch_table",
    "column_type",
    "connect_at",
    "driver_class",
    "driver_class_of",
    "driver_for",
    "edge_table",
    "event_table",
    "index_dialects_for",
    "migration_guard",
    "migration_imports",
    "normalise_url",
    "partial_where",
    "register",
    "registered",
    "sequence_table",
    "side_tables",
    "step_table",
    "stored_generated_dialects",
    "sync_engine_for",
    "table_options",
]

_DRIVERS: dict[str, type[Driver]] = {}


def register(driver: type[Driver]) -> type[Driver]:
    """Make ``driver`` the one for its dialect name (usable as a class decorator)."""
    if not driver.name:
        raise ValueError(f"{driver.__name__} has no dialect name")
    _DRIVERS[driver.name] = driver
    return driver


def registered() -> tuple[type[Driver], ...]:
    """Every registered driver class, in registration order."""
    return tuple(_DRIVERS.values())


def _supported() -> str:
    labels = [d.label or d.name for d in _DRIVERS.values()]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


def driver_class(dialect_name: str) -> type[Driver]:
    """The driver class for a SQLAlchemy dialect name; ConfigError naming the supported ones otherwise."""
    if dialect_name in _DRIVERS:
        return _DRIVERS[dialect_name]
    for driver in _DRIVERS.values():  # one driver may serve several dialects (mysql and mariadb)
        if dialect_name in driver.url_aliases:
            return driver
    raise ConfigError(f"sqla-jobs supports {_supported()}, not {dialect_name!r}")


def driver_class_of(bind: Any) -> type[Driver]:
    """The driver class for an Engine, Connection or Dialect (see :func:`driver_class`)."""
    dialect = getattr(bind, "dialect", bind)
    return driver_class(dialect.name)


def driver_for(bind: Engine | Connection | str, jobs: Table, dead: Table) -> Driver:
    """A driver for ``jobs`` and ``dead`` on the database of ``bind`` (or a dialect name)."""
    if isinstance(bind, str):
        return driver_class(bind)(jobs, dead)
    dialect: Any = bind.dialect
    return driver_class(dialect.name)(jobs, dead, dialect.driver)


def normalise_url(url: URL) -> URL:
    """``url`` with the DBAPI driver sqla-jobs ships for its backend; ConfigError for an unsupported one."""
    backend = url.get_backend_name()
    for driver in _DRIVERS.values():
        if backend in driver.url_aliases:
            return driver.normalise_url(url)
    return driver_class(backend).normalise_url(url)


def side_tables(jobs: Table) -> tuple[Table, ...]:
    """The tables beside a jobs table, made in its metadata (the same Tables after): ``<jobs>_deps`` (job
    graphs), ``<jobs>_batches``, ``<jobs>_steps`` and ``<jobs>_events`` (durable jobs), ``<jobs>_sequences``."""
    return edge_table(jobs), batch_table(jobs), step_table(jobs), event_table(jobs), sequence_table(jobs)


def attach_table_events(table: Table) -> None:
    """Let every backend hook the DDL it adds after ``CREATE TABLE`` of a jobs table."""
    for driver in _DRIVERS.values():
        driver.attach_table_events(table)


# -- the job tables as every registered backend stores them (read when the models are defined) ----------


def column_type(role: str, portable: TypeEngine[Any],
                wrap: Callable[[TypeEngine[Any]], TypeEngine[Any]] | None = None, *,
                none_as_null: bool = False) -> TypeEngine[Any]:
    """``portable``, with each backend's own type for a column of ``role`` as its variant (``Driver.column_type``);
    ``wrap`` is applied to each (the payload's encoder). ``none_as_null`` (JSON): None is SQL NULL, not JSON null."""
    def own(type_: TypeEngine[Any]) -> TypeEngine[Any]:
        if none_as_null:
            type_ = copy.copy(type_)
            type_.none_as_null = True  # type: ignore[attr-defined]
        return wrap(type_) if wrap is not None else type_

    result = own(portable)
    for driver in _DRIVERS.values():
        variant = driver.column_type(role)
        if variant is not None:
            result = result.with_variant(own(variant), *driver.dialect_names())
    return result


def table_options(table: str) -> dict[str, Any]:
    """The dialect options of the jobs table (``"jobs"``) or the dead-letter table (``"dead"``), every backend's."""
    return {key: value for driver in _DRIVERS.values() for key, value in driver.table_options(table).items()}


def index_dialects_for(*, partial: bool) -> tuple[str, ...]:
    """The dialects whose backends have partial indexes (``partial=True``) or not: an index rule's ``ddl_if``."""
    return tuple(n for d in _DRIVERS.values() if d.partial_indexes == partial for n in d.dialect_names())


def partial_where(condition: str) -> dict[str, Any]:
    """An index's WHERE ``condition`` as the options of every dialect that can make the index partial."""
    return {f"{name}_where": text(condition) for name in index_dialects_for(partial=True)}


def stored_generated_dialects() -> tuple[str, ...]:
    """The dialects whose generated columns must be STORED to be indexed."""
    return tuple(n for d in _DRIVERS.values() if d.stores_generated_columns for n in d.dialect_names())


def migration_guard(dialects: tuple[str, ...]) -> str:
    """The test with which an alembic revision runs a step only on ``dialects``, decided where it runs:
    one revision rendered without a database serves every backend."""
    return f"op.get_bind().dialect.name in {dialects!r}"


def migration_imports() -> tuple[str, ...]:
    """The imports a revision needs for every backend's column types, whatever the database at hand."""
    return tuple(sorted({line for d in _DRIVERS.values() for line in d.migration_imports}))


register(PostgreSQLDriver)
register(SQLiteDriver)
register(MySQLDriver)


def sync_engine_for(bind: Any) -> Engine:
    """``bind`` if it is a sync ``Engine``; for an ``AsyncEngine``, a sync engine on the same database
    (its URL's sync twin), for the admin work that runs on plain connections (the dashboard, stats)."""
    if isinstance(bind, Engine):
        return bind
    sync = getattr(bind, "sync_engine", None)
    if not isinstance(sync, Engine):
        raise ConfigError(f"expected a SQLAlchemy Engine or AsyncEngine, got {type(bind).__name__}")
    url = driver_class_of(sync).sync_url(sync.url)
    try:
        return create_engine(url)
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigError(f"the sync twin of {url.render_as_string()!r}: {exc}") from None


def connect_at(engine: Engine, isolation: str) -> Connection:
    """A connection out of ``engine``'s pool at ``isolation`` (put back when it returns to the pool).

    SQLAlchemy sets a connection's isolation with the DBAPI driver's own calls and lets that driver's
    error through as it is (a ``pymysql`` error, not a ``DBAPIError``): on a pooled connection the server
    has meanwhile closed, the worker would take it for a bug rather than a lost connection. Here it is
    raised as the ``DBAPIError`` any statement would raise, the connection invalidated.
    """
    conn = engine.connect()
    try:
        return conn.execution_options(isolation_level=isolation)
    except engine.dialect.loaded_dbapi.Error as exc:
        lost = engine.dialect.is_disconnect(exc, None, None)
        try:
            conn.invalidate()
            conn.close()
        except Exception:  # already broken: nothing left to give back
            pass
        raise DBAPIError.instance(None, None, exc, engine.dialect.loaded_dbapi.Error,
                                  connection_invalidated=lost, dialect=engine.dialect) from exc
    except BaseException:
        conn.close()
        raise
