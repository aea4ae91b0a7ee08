"""What a driver knows before it has tables to work on: URLs, engines, DDL, index rules, the bench.

Mixed into ``Driver`` (base.py). These are class-level hooks: the registry,
``_bootstrap.make_engine``, the models' DDL events and the alembic helpers
call them with only a URL, a table or a connection in hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import Computed, Connection, DateTime, Engine, Index, MetaData, Table, insert, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import TypeEngine

from ..errors import ConfigError

__all__ = ["SCRATCH_PREFIX", "DatabaseNow", "GeneratedColumn", "IndexDefinition", "Setup", "beside", "index_dialects"]

#: The bench's scratch schemas (PostgreSQL) and databases (MariaDB) are named this and the bench's process id.
SCRATCH_PREFIX = "sqla_jobs_bench_"


def beside(jobs: Table, suffix: str, metadata: MetaData | None) -> tuple[MetaData, str, Table | None]:
    """A table beside ``jobs`` (``<jobs><suffix>``, in its schema): the metadata it goes in, its name, and the
    Table if that metadata has it already (job graphs' edges, batches, durable steps and events)."""
    metadata = jobs.metadata if metadata is None else metadata
    name = f"{jobs.name}{suffix}"
    return metadata, name, metadata.tables.get(f"{jobs.schema}.{name}" if jobs.schema else name)


class DatabaseNow(FunctionElement[datetime]):
    """The database clock as a column's server default: ``CURRENT_TIMESTAMP`` unless a driver says otherwise.

    A backend whose timestamp columns have no time zone compiles it to its UTC clock
    (``drivers/mysql/driver.py``), so a row's default is right whatever the session's time zone.
    """

    type = DateTime(timezone=True)
    name = "current_timestamp"
    inherit_cache = True


@compiles(DatabaseNow)
def _current_timestamp(element: DatabaseNow, compiler: Any, **kw: Any) -> str:
    return "CURRENT_TIMESTAMP"


class GeneratedColumn(Computed):
    """A generated column that an index can cover: virtual unless a driver says otherwise.

    SQLite and MariaDB index virtual columns (and SQLite can add only virtual
    ones to an existing table); PostgreSQL 18's virtual columns cannot be
    indexed, so its driver makes them STORED (``drivers/postgresql/driver.py``).
    """

    inherit_cache = True

    def _copy(self, *, target_table: Table | None = None, **kw: Any) -> GeneratedColumn:
        # Computed's copy is a plain Computed; a mixin's columns are copied into each model's table.
        return self._schema_item_copy(GeneratedColumn(self.sqltext, persisted=self.persisted))  # type: ignore[no-any-return]


def index_dialects(index: Index) -> tuple[str, ...] | None:
    """The dialect names an index of the index rules is for (``Index.ddl_if(dialect=...)``); None: every one."""
    rule = getattr(index, "_ddl_if", None)  # where SQLAlchemy keeps ddl_if's condition
    if rule is None or rule.dialect is None:
        return None
    return (rule.dialect,) if isinstance(rule.dialect, str) else tuple(rule.dialect)


#: What a backend's index reflection gives the alembic comparator: unique, elements (``"priority DESC"``),
#: predicate as SQL text; None for an index that exists but whose definition cannot be read.
IndexDefinition = tuple[bool, tuple[str, ...], "str | None"]



class Setup:
    """Class-level hooks of a driver; the defaults suit the plainest backend."""

    name: ClassVar[str] = ""
    url_aliases: ClassVar[tuple[str, ...]] = ()
    jobs: Table

    #: The async DBAPI driver for each sync one this backend takes (``AsyncWorker``, ``worker --async``).
    async_drivers: ClassVar[tuple[tuple[str, str], ...]] = ()

    # -- the job tables as this backend stores them (the models and the alembic helpers ask every
    # registered backend at once: see column_type and the other functions of sqla_jobs/drivers/__init__.py)

    #: The SQLAlchemy dialect names this backend serves, which key its column type variants, table options,
    #: index rules and migration guards; empty: just ``name`` (a URL alias such as ``postgres`` is no dialect).
    dialects: ClassVar[tuple[str, ...]] = ()
    #: Whether an index may carry a WHERE: the index rules then leave out of the pending, running and unique
    #: indexes the rows those never look for; without, ``state`` leads them (``JobMixin.job_indexes``).
    partial_indexes: ClassVar[bool] = False
    #: Whether a generated column that an index covers must be STORED (a rendered revision asks where it runs).
    stores_generated_columns: ClassVar[bool] = False
    #: Imports an alembic revision needs for this backend's column types (``render_type``).
    migration_imports: ClassVar[tuple[str, ...]] = ()
    #: Whether a worker stops its handlers when it cannot renew their leases (``worker/fencing.py``): a
    #: network lies between worker and server. Not for a database file, where a late heartbeat is a busy lock.
    self_fencing: ClassVar[bool] = True

    @classmethod
    def dialect_names(cls) -> tuple[str, ...]:
        return cls.dialects or (cls.name,)

    @classmethod
    def column_type(cls, role: str) -> TypeEngine[Any] | None:
        """This backend's own type for the job tables' columns of ``role`` (``"id"``, ``"json"``,
        ``"timestamp"``), where the portable one will not do; None: the portable one."""
        return None

    @classmethod
    def table_options(cls, table: str) -> dict[str, Any]:
        """Dialect options (``sqlite_autoincrement``, ``mariadb_charset``) of the jobs table (``"jobs"``) or
        the dead-letter table (``"dead"``)."""
        return {}

    @classmethod
    def render_type(cls, type_: Any, imports: set[str], prefix: str) -> str | None:
        """What an alembic revision should say for ``type_``, a column type of this backend's own (adding the
        imports it needs; ``prefix`` is alembic's for ``sqlalchemy``), or None: not one of ours."""
        return None

    @classmethod
    def json_field_text(cls, document: ColumnElement[Any], field: str) -> ColumnElement[str]:
        """A top-level field of the JSON column ``document`` as text, NULL when missing, computed by the database.

        ``field`` is letters, digits, ``_`` and ``-`` (checked where a handler names it), so it may sit in a
        JSON path's text. No default: each backend spells it its own way.
        """
        raise NotImplementedError(f"{cls.__name__} must say how its database reads a JSON field as text")

    @classmethod
    def normalise_url(cls, url: URL) -> URL:
        """The URL with the DBAPI driver sqla-jobs ships for this backend."""
        return url

    @classmethod
    def async_url(cls, url: URL) -> URL:
        """``url`` (normalised) on this backend's async driver; ConfigError when it has none."""
        if url.get_dialect().is_async:
            return url
        drivername = dict(cls.async_drivers).get(url.drivername)
        if drivername is None:
            raise ConfigError(f"{url.drivername}: no async driver known for it; give an async URL "
                              f"(one of {', '.join(sorted({a for _, a in cls.async_drivers})) or 'none'})")
        return url.set(drivername=drivername)

    @classmethod
    def sync_url(cls, url: URL) -> URL:
        """``url`` on the sync driver twin of its async one (an async worker's plain transactional handlers)."""
        for sync, asynchronous in cls.async_drivers:
            if url.drivername == asynchronous:
                return url.set(drivername=sync)
        return url

    @classmethod
    def connect_args(cls, url: URL) -> tuple[URL, dict[str, Any]]:
        """``url`` less the query settings sqla-jobs reads itself, and the ``connect()`` arguments they mean."""
        return url, {}

    @classmethod
    def missing_database(cls, url: URL) -> str | None:
        """Where ``url``'s database would be if it does not exist and connecting would create it (a file)."""
        return None

    @classmethod
    def attach_table_events(cls, table: Table) -> None:
        """Hook DDL that must follow ``CREATE TABLE`` of a jobs table (e.g. a wake-up trigger)."""

    @classmethod
    def wake_trigger_migration(cls, table: Table) -> tuple[str, str, str] | None:
        """Alembic upgrade and downgrade code for this backend's wake-up trigger and a one-line summary,
        or None (it has none).

        The code guards itself on the dialect, so one revision serves every backend.
        """
        return None

    @classmethod
    def table_settings_migration(cls, table: Table) -> str | None:
        """Alembic upgrade code for the settings this backend gives a jobs table it creates (guarded on the
        dialect like ``wake_trigger_migration``; the downgrade drops the table with them), or None."""
        return None

    @classmethod
    def applies(cls, index: Index) -> bool:
        """Whether ``index`` is built on this backend (the index rules may name the dialects an index is for)."""
        names = index_dialects(index)
        return names is None or bool(set(names) & {cls.name, *cls.url_aliases})

    @classmethod
    def creates_schemas(cls) -> bool:
        """Whether a table's ``schema`` is a namespace to create (False: an attached database, say)."""
        return False

    @classmethod
    def reflect_indexes(cls, conn: Connection, schema: str | None, table: str) -> dict[str, IndexDefinition | None]:
        """The indexes of ``table`` as the database has them, for the alembic comparator."""
        raise NotImplementedError

    @classmethod
    def check_reflected_table(cls, conn: Connection, schema: str | None, table: Table) -> None:
        """Log what alembic cannot restore about ``table`` as the database has it (nothing by default)."""

    @classmethod
    @contextmanager
    def bench_scratch(cls, url: URL) -> Iterator[URL]:
        """A URL whose tables are the bench's own, removed afterwards."""
        raise NotImplementedError
        yield url  # pragma: no cover

    def create_partitioned(self, conn: Connection) -> None:
        """``create`` with the jobs table partitioned so finished jobs leave the hot table
        (``create-tables --partitioned``); an existing jobs table is left as it is."""
        raise ConfigError(f"--partitioned: {self.name} has no partitioned mode (it is PostgreSQL's)")

    @classmethod
    def partitioned_migration(cls, table: Table) -> tuple[str, str, str] | None:
        """Alembic upgrade and downgrade code creating ``table`` partitioned, and a summary line
        (``migrations render --partitioned``); None where the backend has no such mode."""
        return None

    @classmethod
    def layout_indexes(cls, table_name: str) -> set[str]:
        """Names of indexes a layout of this backend adds to a jobs table beyond the model's (the alembic
        comparator leaves them alone): none by default."""
        return set()

    @classmethod
    def layout_table(cls, table_name: str, name: str) -> bool:
        """Whether table ``name`` is one a layout of this backend adds for the jobs table ``table_name``
        (a partition: alembic's autogenerate leaves it alone); never, by default."""
        return False

    def upkeep(self, conn: Connection) -> None:
        """What the maintenance leader does for the table now and then, besides reaping and pruning
        (partitioned PostgreSQL: make the coming days' partitions); nothing by default."""

    def harden(self, engine: Engine, worker_name: str) -> None:
        """Make ``engine``'s connections notice a dead network (nothing by default)."""

    def is_disconnect(self, exc: BaseException) -> bool:
        """Whether ``exc`` means the connection (or the server) is gone, not that a statement failed."""
        return isinstance(exc, DBAPIError) and exc.connection_invalidated

    @classmethod
    def is_read_only(cls, exc: BaseException) -> bool:
        """Whether ``exc`` says the server takes no writes (a standby, a server switched to read-only):
        the worker waits for a writable one and charges no attempt (nothing by default)."""
        return False

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the transaction lost a race with another one (a deadlock, a
        serialization failure): nothing is wrong, and running the transaction again is the cure."""
        return isinstance(exc, DBAPIError) and getattr(exc.orig, "sqlstate", None) in {"40001", "40P01"}

    def bench_table_stats(self, conn: Connection) -> dict[str, float]:
        """The jobs table's size and churn as the soak plots them (``table_bytes``, ``index_bytes``,
        ``live_tuples``, ``dead_tuples``, ``hot_update_share``, ``autovacuum_count``, ...); what the
        backend cannot tell is left out (nothing by default)."""
        return {}

    def bench_vacuum(self, conn: Connection) -> None:
        """Reclaim the jobs table's dead rows now, as autovacuum would (``conn`` in autocommit)."""
        raise ConfigError(f"--soak-vacuum: {self.name} has no VACUUM of one table (it is PostgreSQL's)")

    def bench_storage(self, conn: Connection, parameters: dict[str, str]) -> None:
        """Set the jobs table's storage parameters (``fillfactor``, ``autovacuum_*``) for a bench run."""
        raise ConfigError(f"--storage: {self.name} has no table storage parameters (they are PostgreSQL's)")

    #: Whether ``bench_cut_connections`` can drop connections from the server side.
    bench_cuts_connections = False

    def bench_cut_connections(self, conn: Connection) -> int:
        """Drop every worker's connection to this database from the server side, as a failover or a proxy
        restart would (the soak's ``cut`` fault); how many."""
        raise ConfigError(f"{self.name} cannot drop other sessions' connections")

    def bench_analyze(self, conn: Connection) -> None:
        """Refresh the jobs table's planner statistics, as the server's own upkeep soon would after a burst
        (autovacuum's ANALYZE): a scene measured on a table its statistics know, as in production."""
        conn.execute(text(f"ANALYZE {conn.dialect.identifier_preparer.format_table(self.jobs)}"))

    def bench_fill_finished(self, conn: Connection, rows: int) -> None:
        """Insert ``rows`` old finished jobs, as an unpruned queue has (the bench's background)."""
        conn.execute(insert(self.jobs), [{"kind": "noop", "payload": {}, "state": "finished", "attempts": 1}] * rows)
