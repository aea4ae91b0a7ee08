"""PostgreSQL's partitioned mode: finished jobs leave the hot table, retention drops whole days.

The jobs table is declared ``PARTITION BY LIST (state)``, with two partitions:

``<table>_live``   pending and running jobs: what the claim, the reaper and the
                   heartbeat read and write; small, whatever the history holds
``<table>_blocked``  jobs waiting for the jobs they depend on (``sqla_jobs._graph``)
``<table>_done``   finished and cancelled jobs, itself ``PARTITION BY RANGE
                   (finished_at)``: one partition per UTC day
                   (``<table>_done_YYYYMMDD``) and a DEFAULT one for rows no day
                   partition takes (a day not made yet, a NULL ``finished_at``)

Finishing a job is the same ``UPDATE … SET state = 'finished'``: PostgreSQL
moves the row into today's partition. Every statement sqla-jobs runs names the
state it expects, so the planner prunes to ``_live`` on the hot path. The
``Job`` model, ``get_job``, the admin commands, stats and the dashboard read
the parent table as before.

Why LIST by state rather than a separate history table: one logical table
keeps every reader unchanged (an ORM ``session.get(Job, id)`` of a finished
job still works) and the move is the UPDATE the worker already makes.

What differs from the plain table:

* **No primary key in the database.** A partitioned table's unique indexes
  must contain the partition columns; ``(id, state, finished_at)`` cannot be
  one (``finished_at`` is NULL while a job is live). ``id`` stays the model's
  identity; its values come from one sequence, and every partition carries
  ``ix_<table>_id``.
* **Unique keys** are enforced among live jobs by ``ux_<table>_unique`` on
  ``_live``. A key kept in ``finished``/``cancelled`` (periodic slots) is
  checked after the insert, in the same transaction, against the done
  partitions (``insert_unique``); see docs/howto/partitioning.md for the one
  case this does not cover (a caller in REPEATABLE READ).
* **Retention** is by whole day: ``prune`` drops the day partitions that ended
  before the cutoff (``DROP TABLE``, no dead rows, nothing to vacuum) and
  deletes old rows of the DEFAULT partition in batches.
* **Future days** are created ahead (``DAYS_AHEAD``) by ``create-tables`` and
  then by the maintenance leader (``ensure_days``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import date, datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Connection, Engine, Table, insert, inspect, select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.schema import CreateColumn, CreateIndex

from ...errors import SchemaError
from .._unique import Uniqueness
from ..base import Driver
from .notify import pg_name

__all__ = [
    "DAYS_AHEAD",
    "LIVE_STATES",
    "PartitionedMode",
    "as_the_model_has_them",
    "blocked_name",
    "create_statements",
    "day_partitions",
    "done_name",
    "drop_expired",
    "ensure_days",
    "insert_unique",
    "is_partitioned",
    "live_name",
    "size_report",
]

#: Day partitions made ahead of time: the leader can be away this long before rows reach DEFAULT.
DAYS_AHEAD = 3
LIVE_STATES = ("pending", "running")
DONE_STATES = ("finished", "cancelled")
#: How long a DROP waits for its lock: it needs the done table exclusively for an instant, and
#: must not queue the workers' finishes behind a long reader. It is tried again at the next prune.
_LOCK_TIMEOUT = "2s"

_DIALECT = postgresql.dialect()
_QUOTE = _DIALECT.identifier_preparer


def _sibling(table: Table, suffix: str) -> str:
    """The quoted, schema-qualified name of ``<table><suffix>`` (PostgreSQL caps names at 63 bytes)."""
    name = _QUOTE.quote(f"{table.name}{suffix}"[:63])
    return f"{_QUOTE.quote_schema(table.schema)}.{name}" if table.schema else name


def live_name(table: Table) -> str:
    return _sibling(table, "_live")


def done_name(table: Table) -> str:
    return _sibling(table, "_done")


def blocked_name(table: Table) -> str:  # jobs waiting for their upstreams (sqla_jobs._graph), out of `_live`
    return _sibling(table, "_blocked")


def _blocked_partition(table: Table) -> str:
    return f"CREATE TABLE {blocked_name(table)} PARTITION OF {pg_name(table)} FOR VALUES IN ('blocked')"


def _day_suffix(day: date) -> str:
    return f"_done_{day:%Y%m%d}"


def create_statements(table: Table, days_ahead: int = DAYS_AHEAD, today: date | None = None) -> list[str]:
    """DDL for ``table`` as a partitioned table, its partitions and indexes, today's day and ``days_ahead`` more.

    The columns are the model's, compiled as ``CREATE TABLE`` would; the index rules are the
    model's too, on the parent (so every partition has them), except the unique key's index,
    which a partitioned table cannot hold: it goes on ``_live`` (see the module docstring).
    """
    columns = ",\n    ".join(str(CreateColumn(c).compile(dialect=_DIALECT)) for c in table.columns)
    statements = [
        f"CREATE TABLE {pg_name(table)} (\n    {columns}\n) PARTITION BY LIST (state)",
        f"CREATE TABLE {live_name(table)} PARTITION OF {pg_name(table)} FOR VALUES IN ('pending', 'running')",
        _blocked_partition(table),
        f"CREATE TABLE {done_name(table)} PARTITION OF {pg_name(table)} FOR VALUES IN ('finished', 'cancelled') "
        "PARTITION BY RANGE (finished_at)",
        f"CREATE TABLE {_sibling(table, '_done_default')} PARTITION OF {done_name(table)} DEFAULT",
        f"CREATE INDEX {_QUOTE.quote(f'ix_{table.name}_id'[:63])} ON {pg_name(table)} (id)",
    ]
    for index in sorted(table.indexes, key=lambda ix: str(ix.name)):
        if not _applies(index):
            continue
        ddl = str(CreateIndex(index).compile(dialect=_DIALECT))
        if index.unique:
            # Unique on the live partition; a plain twin on the parent finds the holder in any partition.
            statements.append(ddl.replace(f" ON {pg_name(table)} ", f" ON {live_name(table)} ", 1))
            twin = _QUOTE.quote(f"ix_{table.name}_unique_held"[:63])
            statements.append(ddl.replace("CREATE UNIQUE INDEX", "CREATE INDEX", 1)
                              .replace(_QUOTE.quote(str(index.name)), twin, 1))
        else:
            statements.append(ddl)
    start = today or _utc_today()
    statements.extend(_day_ddl(table, start + timedelta(days=n)) for n in range(days_ahead + 1))
    return statements


def _applies(index: Any) -> bool:
    rule = getattr(index, "_ddl_if", None)
    if rule is None or rule.dialect is None:
        return True
    names = (rule.dialect,) if isinstance(rule.dialect, str) else tuple(rule.dialect)
    return "postgresql" in names


def _utc_today() -> date:
    return datetime.now(timezone.utc).date()


def _day_ddl(table: Table, day: date) -> str:
    start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    end = start + timedelta(days=1)
    return (f"CREATE TABLE IF NOT EXISTS {_sibling(table, _day_suffix(day))} PARTITION OF {done_name(table)} "
            f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')")


# -- finding out -------------------------------------------------------------------------

#: Per engine (a driver serves every database of its dialect): whether its jobs table is partitioned.
_KNOWN: weakref.WeakKeyDictionary[Engine, dict[str, bool]] = weakref.WeakKeyDictionary()


def is_partitioned(conn: Connection, table: Table) -> bool:
    """Whether ``table`` is partitioned in ``conn``'s database; asked once per engine and table."""
    known = _KNOWN.setdefault(conn.engine, {})
    key = table.fullname
    if key not in known:
        row = conn.execute(text(
            "SELECT to_regclass(:t) IS NOT NULL, EXISTS (SELECT FROM pg_partitioned_table WHERE partrelid = "
            "to_regclass(:t))"
        ), {"t": pg_name(table)}).one()
        if not row[0]:
            return False  # not created yet: ask again next time
        known[key] = bool(row[1])
    return known[key]


def forget(conn: Connection, table: Table) -> None:
    """Drop what ``is_partitioned`` remembers (the table was just created)."""
    _KNOWN.get(conn.engine, {}).pop(table.fullname, None)


def day_partitions(conn: Connection, table: Table) -> dict[date, str]:
    """The day partitions of ``table``'s done partition, by day (quoted names)."""
    prefix = f"{table.name}_done_"[:63]
    rows = conn.execute(text(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = to_regclass(:done)"
    ), {"done": done_name(table)}).scalars()
    found = {}
    for name in rows:
        suffix = name[len(prefix):] if name.startswith(prefix) else ""
        if len(suffix) == 8 and suffix.isdigit():
            day = date(int(suffix[:4]), int(suffix[4:6]), int(suffix[6:]))
            found[day] = _sibling(table, _day_suffix(day))
    return found


def as_the_model_has_them(conn: Connection, schema: str | None, table: str, found: dict[str, Any],
                          reflect: Callable[[Connection, str | None, str], dict[str, Any]]) -> dict[str, Any]:
    """The reflected indexes of a partitioned jobs table as the alembic comparator should see them: with
    the unique key's index, which is on ``_live`` (the two this mode adds are ``layout_indexes``), so that
    ``migrations render --url`` renders only what a newer sqla-jobs adds, not this layout's differences."""
    target = f"{_QUOTE.quote_schema(schema)}.{_QUOTE.quote(table)}" if schema else _QUOTE.quote(table)
    parted = conn.execute(text("SELECT EXISTS (SELECT FROM pg_partitioned_table WHERE partrelid = to_regclass(:t))"),
                          {"t": target}).scalar()
    if not parted:
        return found
    unique = f"ux_{table}_unique"[:63]
    live = reflect(conn, schema, f"{table}_live"[:63])
    if unique in live:
        found[unique] = live[unique]
    return found


# -- unique keys ---------------------------------------------------------------------------

def insert_unique(driver: Uniqueness, conn: Connection, row: dict[str, Any]) -> int | None:
    """``Driver.insert_unique`` on a partitioned table: the new job's id, or None when its key is held.

    A live holder: ``_live``'s unique index refuses the INSERT (rolled back to a savepoint).
    A holder in the done partitions (its key kept while finished or cancelled) is looked for
    after the INSERT, in the statement's fresh snapshot (READ COMMITTED): a holder whose finish
    was moving it out of ``_live`` while the INSERT waited on it is seen there, so the INSERT
    is undone. Every other order of the two is covered by the index itself.
    """
    t = driver.jobs
    savepoint = conn.begin_nested()
    try:
        new_id = conn.execute(insert(t).values(**driver.unique_values(row)).returning(t.c.id)).scalar_one()
    except IntegrityError as exc:
        savepoint.rollback()  # only the INSERT is undone: the caller's transaction goes on
        if driver.is_duplicate_key(exc):
            return None
        raise
    done = select(t.c.id).where(t.c.unique_held == row["unique_key"], t.c.state.in_(DONE_STATES)).limit(1)
    if conn.execute(done).first() is not None:
        savepoint.rollback()
        return None
    savepoint.commit()
    return int(new_id)


# -- upkeep (the maintenance leader) --------------------------------------------------------

def ensure_days(conn: Connection, table: Table, days_ahead: int = DAYS_AHEAD, today: date | None = None) -> list[date]:
    """Create the day partitions from today to ``days_ahead`` days on that are missing; the days made.

    A day whose rows already sit in the DEFAULT partition (the leader was away) cannot be
    made without moving them: it is skipped, and its rows are pruned from DEFAULT by age.
    """
    start = today or conn.execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()
    have = day_partitions(conn, table)
    made = []
    for n in range(days_ahead + 1):
        day = start + timedelta(days=n)
        if day in have:
            continue
        savepoint = conn.begin_nested()
        try:
            conn.execute(text(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'"))
            conn.execute(text(_day_ddl(table, day)))
        except DBAPIError:
            savepoint.rollback()  # rows of that day in DEFAULT, or the lock not granted: left for later
            continue
        savepoint.commit()
        made.append(day)
    return made


def drop_expired(conn: Connection, table: Table, older_than: float, limit: int) -> int:
    """Drop the day partitions that ended more than ``older_than`` seconds ago, then delete up to
    ``limit`` old rows of the DEFAULT partition. Returns the rows removed (those of the dropped days counted).

    The drops need the done table's exclusive lock for an instant (not the live partition's:
    claims go on); ``lock_timeout`` keeps them from queueing the workers' finishes behind a long
    reader, and a drop that times out is tried again at the next prune.
    """
    cutoff = conn.execute(text("SELECT now() - make_interval(secs => :s)"), {"s": float(older_than)}).scalar_one()
    expired = [name for day, name in sorted(day_partitions(conn, table).items())
               if datetime(day.year, day.month, day.day, tzinfo=timezone.utc) + timedelta(days=1) <= cutoff]
    removed = 0
    for name in expired:
        rows = int(conn.execute(text(f"SELECT count(*) FROM {name}")).scalar_one())
        savepoint = conn.begin_nested()
        try:
            conn.execute(text(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'"))
            conn.execute(text(f"DROP TABLE {name}"))
        except DBAPIError:
            savepoint.rollback()  # the lock was not granted in time: the next prune tries again
            break
        savepoint.commit()
        removed += rows
    default = _sibling(table, "_done_default")
    return removed + conn.execute(text(
        f"DELETE FROM {default} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {default} "
        "WHERE finished_at < :cutoff LIMIT :n FOR UPDATE SKIP LOCKED))"
    ), {"cutoff": cutoff, "n": limit}).rowcount


def size_report(conn: Connection, table: Table) -> dict[str, int]:
    """Bytes of heap and of heap plus indexes for the whole table and for its live partition."""
    row = conn.execute(text(
        "SELECT sum(pg_relation_size(relid)), sum(pg_total_relation_size(relid)) FROM pg_partition_tree(:t)"
    ), {"t": pg_name(table)}).one()
    live = conn.execute(text("SELECT pg_relation_size(:l), pg_total_relation_size(:l)"),
                        {"l": live_name(table)}).one()
    return {"table_bytes": int(row[0] or 0), "total_bytes": int(row[1] or 0),
            "live_table_bytes": int(live[0]), "live_total_bytes": int(live[1])}


_MOVE_RETRIES = 5  # tries of an admin write that lost a race with a row's move to another partition


class PartitionedMode(Driver):
    """The partitioned mode's driver methods, mixed into ``PostgreSQLDriver`` (whose module is full)."""

    def create_partitioned(self, conn: Connection) -> None:
        if not inspect(conn).has_table(self.jobs.name, schema=self.jobs.schema):
            for statement in create_statements(self.jobs):
                conn.execute(text(statement))
            forget(conn, self.jobs)
        elif is_partitioned(conn, self.jobs) and not self._has_blocked_partition(conn):
            conn.execute(text(_blocked_partition(self.jobs)))  # made before job graphs (sqla_jobs._graph)
        self.create(conn)  # the dead-letter table and the trigger; the jobs table's indexes exist by name

    def _has_blocked_partition(self, conn: Connection) -> bool:
        return conn.scalar(text("SELECT to_regclass(:name)"), {"name": blocked_name(self.jobs)}) is not None

    def check_schema(self, conn: Connection) -> None:
        super().check_schema(conn)
        if is_partitioned(conn, self.jobs) and not self._has_blocked_partition(conn):
            raise SchemaError(
                f"partitioned table {self.jobs.fullname!r} has no partition for blocked jobs (job graphs, added "
                "after it was made): run `sqla-jobs create-tables --partitioned --app ...`, or this in a "
                f"migration: {_blocked_partition(self.jobs)}")

    def cancel(self, conn: Connection, job_id: int) -> tuple[bool, str | None]:
        """``Driver.cancel``, retried when the job moved partition under it (its run finished meanwhile).

        In READ COMMITTED an UPDATE that waited for a row can follow it to its new version, but not into
        another partition: PostgreSQL raises a serialization failure instead. A savepoint keeps the
        caller's transaction; the second try finds the job where it now is (finished: too late to cancel).
        """
        if not is_partitioned(conn, self.jobs):
            return super().cancel(conn, job_id)
        for attempt in range(_MOVE_RETRIES):
            try:
                with conn.begin_nested():
                    return super().cancel(conn, job_id)
            except DBAPIError as exc:
                if not self.is_conflict(exc) or attempt == _MOVE_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises

    @classmethod
    def partitioned_migration(cls, table: Table) -> tuple[str, str, str] | None:
        # No day partitions: the revision may run days after it was rendered; the first worker
        # to lead makes today's and the coming days' (until then finished rows go to DEFAULT).
        guard = (f'    if op.get_bind().dialect.name != "{cls.name}":\n'
                 f'        raise NotImplementedError("a partitioned jobs table is {cls.label}\'s alone")\n')
        body = "".join(f"    op.execute({statement!r})\n" for statement in create_statements(table, days_ahead=-1))
        summary = f"create table {table.name} partitioned by state, finished jobs by day ({cls.label})"
        return guard + body.rstrip("\n"), f"    op.execute({f'DROP TABLE {pg_name(table)}'!r})", summary

    @classmethod
    def layout_indexes(cls, table_name: str) -> set[str]:
        return {f"ix_{table_name}_id"[:63], f"ix_{table_name}_unique_held"[:63]}

    @classmethod
    def layout_table(cls, table_name: str, name: str) -> bool:
        prefix = f"{table_name}_done_"
        rest = name[len(prefix):] if name.startswith(prefix) else ""
        return name in (f"{table_name}_live", f"{table_name}_done", f"{table_name}_blocked") or rest == "default" or (
            len(rest) == 8 and rest.isdigit())

    def creatable_indexes(self, conn: Connection, table: Table) -> list[Any]:
        found = super().creatable_indexes(conn, table)
        if table is self.jobs and is_partitioned(conn, table):  # a partitioned table holds no unique index
            return [ix for ix in found if not ix.unique]
        return found

    def upkeep(self, conn: Connection) -> None:
        if is_partitioned(conn, self.jobs):
            ensure_days(conn, self.jobs)

    def prune_batch(self, conn: Connection, older_than: float, limit: int) -> int:
        if is_partitioned(conn, self.jobs):  # whole days dropped, not rows deleted
            return drop_expired(conn, self.jobs, older_than, limit)
        return super().prune_batch(conn, older_than, limit)
