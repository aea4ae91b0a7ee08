"""The PostgreSQL driver (psycopg 3).

================  ===========================================================
claim             a MATERIALIZED CTE with ``FOR UPDATE SKIP LOCKED``, fused
                  with the previous batch's finish: one round trip per batch
now / later       ``now()`` + interval
append an error   ``errors || jsonb``
wake-up           ``pg_notify`` at commit, a statement-level INSERT trigger
insert_many       COPY
prune lock        a transaction-level advisory lock
keepalives        libpq and server-side TCP settings (``keepalive.py``)
================  ===========================================================
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    Engine,
    Interval,
    Select,
    Table,
    Text,
    cast,
    func,
    literal,
    select,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.elements import ColumnElement

from ...errors import ConfigError
from .._durable import upsert_statement
from .._graph import SKIPPED
from .._unique import on_conflict_insert
from ..base import Claimed, Fence
from . import capped, fair, handoff, keepalive, moves, partitions
from .async_listen import PgAsyncListener
from .bench import PgBench
from .claim import CLAIMED, run_claim
from .copy import copy_rows
from .durable import PgDurable
from .listen import PgListener
from .notify import notify_channel, notify_trigger_ddl, notify_trigger_name, pg_name
from .partitions import PartitionedMode
from .schema import PgSchema
from .vacuum import PgVacuum

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["PostgreSQLDriver", "notify_channel", "notify_trigger_ddl", "notify_trigger_name"]


# The worker's hot path on PostgreSQL, written out so it is built once and is
# one round trip. `done` finishes the last batch, fenced pair by pair (an
# `id = ANY(ids) AND token = ANY(tokens)` test could match a job we re-claimed
# under another token); the pairs travel as one "id:token,…" string because
# the driver's array adaptation was a quarter of the worker's time. `due` is
# MATERIALIZED so exactly `limit` rows are locked; `claimed` takes them, except
# jobs marked `isolate` (their worker was lost while they ran): an idle worker
# (`alone`) takes the most urgent of those and nothing else; a busy one leaves
# them and learns of them from the rows with `claimed` NULL. A worker that keeps no finished
# jobs (Driver.discarding_finished) deletes them in `done` instead. A job that others depend on is
# finished here only when the worker names it, and its dependents are counted down by the next statement
# of the transaction; else it is left to Driver.finish (handoff.py says why).
_PG_FINISH_AND_CLAIM = """
WITH done AS (
    {finish} (
        SELECT split_part(pair, ':', 1)::bigint AS id, split_part(pair, ':', 2) AS token
        FROM unnest(string_to_array(%(fences)s, ',')) AS pair
    ) AS f
    WHERE j.id = f.id AND j.claim_token = f.token AND j.state = 'running'{dependents}
    RETURNING j.id
), due AS MATERIALIZED (
    SELECT id, isolate, priority, run_at FROM {live}
    WHERE state = 'pending' AND run_at <= now() {queue_filter}{skip_filter}
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), alone AS (
    SELECT id FROM due WHERE isolate AND %(alone)s ORDER BY priority DESC, run_at, id LIMIT 1
), """ + CLAIMED + """UNION ALL
SELECT false, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM done
UNION ALL
SELECT NULL, id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM due
WHERE isolate AND id NOT IN (SELECT id FROM alone)
"""


class PostgreSQLDriver(PgDurable, fair.PgFair, PgSchema, PgVacuum, PgBench, PartitionedMode, moves.MovedRows):
    """PostgreSQL: see the module docstring; the partitioned mode's methods are in ``pg_partitions``."""

    name = "postgresql"
    label = "PostgreSQL"
    url_aliases = ("postgres",)
    async_drivers = (("postgresql+psycopg", "postgresql+psycopg_async"),)

    def __init__(self, jobs: Table, dead: Table, dbapi: str | None = None) -> None:
        super().__init__(jobs, dead, dbapi)
        self._channel = notify_channel(jobs)
        # 64 variants: by queue or not; skipping limited kinds (bit 1: claimed by drivers/_limits.py in the same
        # transaction) and fair queues (bit 2: fair.py), or not: without either the statement is unchanged;
        # a plain table or a partitioned one (pg_partitions), claimed from its live partition named
        # directly: a state filter on the parent would let the planner walk the pending index in the UPDATE;
        # finishing by UPDATE or by DELETE (a worker that keeps no finished jobs); finishing the jobs with
        # dependents the worker names (handoff.py), or leaving them all.
        self._pg_hot = {(by_queue, skip, parted, discard, named): _PG_FINISH_AND_CLAIM.format(
            finish=fair.FINISH[discard].format(table=pg_name(jobs)),
            live=partitions.live_name(jobs) if parted else pg_name(jobs),
            queue_filter="AND queue = ANY(%(queues)s::text[])" if by_queue else "",
            skip_filter=fair.SKIP_FILTERS[skip],
            dependents=handoff.TAKE_FLAGGED if named else handoff.DECLINE,
        ) for by_queue in (False, True) for skip in range(4) for parted in (False, True)
            for discard in (False, True) for named in (False, True)}
        self._handoff = handoff.handoff_sql(jobs, self.edges)

    @property
    def supports_listen(self) -> bool:
        return self.dbapi in (None, "psycopg")  # the listener uses psycopg's notifies()

    @property
    def supports_copy(self) -> bool:
        return True

    @property
    def hot_isolation(self) -> str | None:
        # Each hot write is one fenced statement, atomic on its own: BEGIN and COMMIT would buy nothing.
        return "AUTOCOMMIT"

    @property
    def channel(self) -> str:
        return self._channel

    def listener(self, engine: Engine, wake: Callable[[], None], worker_name: str) -> PgListener | None:
        return PgListener(engine, self._channel, wake, worker_name) if self.supports_listen else None

    def async_listener(self, engine: AsyncEngine, wake: Callable[[], None],
                       worker_name: str) -> PgAsyncListener | None:
        return PgAsyncListener(engine, self._channel, wake, worker_name) if self.supports_listen else None

    # -- class level ---------------------------------------------------------------

    @classmethod
    def normalise_url(cls, url: URL) -> URL:
        if url.drivername in ("postgresql", "postgres"):
            return url.set(drivername="postgresql+psycopg")  # psycopg 3 is our dependency, psycopg2 is not
        return url

    @classmethod
    def connect_args(cls, url: URL) -> tuple[URL, dict[str, Any]]:
        """``?prepare_threshold=none`` (or a number): psycopg's own setting, which its URL cannot carry.

        psycopg prepares a statement on the server once a connection has run it
        ``prepare_threshold`` times (5); the worker's claim statement gets there
        within seconds. Behind PgBouncer in transaction mode (before 1.21's
        ``max_prepared_statements``) the next transaction may run on another
        server connection, which lacks the statement: ``prepared statement
        "_pg3_0" does not exist``. ``none`` turns preparing off for every
        connection of the engine, the hot path's included.
        """
        raw = url.query.get("prepare_threshold")
        if raw is None:
            return url, {}
        if isinstance(raw, tuple):
            raise ConfigError("--url: give prepare_threshold once")
        if url.get_driver_name() not in ("psycopg", "psycopg_async"):  # the async worker's dialect is psycopg too
            raise ConfigError(f"--url: prepare_threshold is a setting of psycopg 3, not of {url.get_driver_name()}")
        value: int | None
        if raw.strip().lower() in ("none", "null", "off", ""):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                value = -1
            if value < 0:
                raise ConfigError(f"--url: prepare_threshold={raw!r} must be none (never prepare, for PgBouncer "
                                  "in transaction mode) or a count of executions >= 0") from None
        return url.difference_update_query(["prepare_threshold"]), {"prepare_threshold": value}

    def harden(self, engine: Engine, worker_name: str) -> None:
        keepalive.harden(engine, worker_name)  # keepalives, timeouts, application_name

    def is_disconnect(self, exc: BaseException) -> bool:
        return keepalive.is_disconnect(exc)

    @classmethod
    def is_read_only(cls, exc: BaseException) -> bool:
        # read_only_sql_transaction: a hot standby, or default_transaction_read_only switched on
        return getattr(getattr(exc, "orig", exc), "sqlstate", None) == "25006"

    # -- time, wake-up -------------------------------------------------------

    def now(self) -> ColumnElement[datetime]:
        return func.now()

    def later(self, seconds: float) -> ColumnElement[datetime]:
        return func.now() + literal(timedelta(seconds=seconds), Interval())

    def seconds_between(self, later: Any, earlier: Any) -> ColumnElement[float]:
        return func.extract("epoch", later - earlier)

    def server_uptime(self, conn: Connection) -> float | None:
        return float(conn.scalar(select(self.seconds_between(func.now(), func.pg_postmaster_start_time()))))

    def notify(self, conn: Connection) -> None:
        conn.execute(select(func.pg_notify(self._channel, "")))

    # -- the worker's path -----------------------------------------------------

    def finish_and_claim(
        self,
        conn: Connection,
        fences: Sequence[Fence],
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        *,
        alone: bool = False,
        skip_kinds: Sequence[str] = (),
        upstreams: Sequence[int] = (),
    ) -> tuple[set[int], list[Claimed], bool]:
        return self._pg_finish_and_claim(conn, fences, limit, worker, token, lease, queues, ordered=False, alone=alone,
                                         skip_kinds=skip_kinds, upstreams=upstreams)

    def _pg_finish_and_claim(
        self,
        conn: Connection,
        fences: Sequence[Fence],
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        *,
        ordered: bool,
        alone: bool,
        skip_kinds: Sequence[str] = (),
        upstreams: Sequence[int] = (),
    ) -> tuple[set[int], list[Claimed], bool]:
        named = bool(upstreams) and not self.discard_finished  # a deleted upstream leaves no row to count from
        params = {
            "fences": ",".join(f"{job_id}:{job_token}" for job_id, job_token in fences),
            "limit": limit,
            "worker": worker,
            "token": token,
            "lease": float(lease),
            "queues": list(queues or ()),
            "alone": alone,
            "skip": list(skip_kinds), "skip_queues": self.skip_queues,
            "flagged": ",".join(map(str, upstreams)) if named else "",
        }
        # The driver's cursor directly: this runs once per batch, and SQLAlchemy's
        # result machinery was a fifth of the worker's time. Errors are wrapped
        # back into SQLAlchemy's, which is what the worker's retry loop expects.
        sql = self._pg_hot[bool(queues), bool(skip_kinds) | (2 if self.skip_queues else 0),
                           partitions.is_partitioned(conn, self.jobs), self.discard_finished, named]
        after = (self._handoff, {"flagged": params["flagged"], "channel": self._channel,
                                 "skipped": SKIPPED}) if named else None
        if not conn.in_transaction():
            # SQLAlchemy does not see what the driver cursor runs: without this its commit
            # (e.g. Driver.write's) would be a no-op and the pool would roll the claim back.
            conn.begin()
        try:
            rows = run_claim(conn.connection.driver_connection, sql, params, after)
        except Exception as exc:
            if isinstance(exc, conn.dialect.loaded_dbapi.Error):
                raise DBAPIError.instance(sql, params, exc, conn.dialect.loaded_dbapi.Error) from exc
            raise
        finished = {r[1] for r in rows if r[0] is False}  # one row per job finished: ids do not repeat
        claimed = [r for r in rows if r[0]]
        waiting = len(rows) > len(finished) + len(claimed)  # rows with NULL: isolated jobs left for an idle worker
        if ordered:  # the worker does not need it: a batch never exceeds its free threads, all start at once
            claimed.sort(key=lambda r: (-r[7], r[8], r[1]))
        jobs = [Claimed(r[1], r[2], r[3], r[4], r[5], r[6], r[7], token, bool(r[9]), bool(r[10])) for r in claimed]
        return finished, jobs, waiting

    def claim_batch(
        self,
        conn: Connection,
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        alone: bool,
        skip_kinds: Sequence[str] = (),
    ) -> tuple[list[Claimed], bool]:
        # The worker's own statement, so what is tested is what runs.
        _, jobs, waiting = self._pg_finish_and_claim(
            conn, [], limit, worker, token, lease, queues, ordered=True, alone=alone, skip_kinds=skip_kinds
        )
        return jobs, waiting

    # Kinds with a plain running limit: capped.py.
    def claim_capped(self, conn: Connection, limits: Table, row: str, kind: str, running: int, budget: int,
                     worker: str, token: str, lease: float, queues: Sequence[str] | None,
                     alone: bool) -> tuple[list[Claimed], bool] | None:
        stmts = capped.statements(conn, self.jobs, limits, bool(queues), self._pg_hot_for(conn, queues))
        return capped.claim_capped(conn, stmts, row, kind, running, budget, worker, token, lease, queues, alone)

    def finish_and_claim_capped(self, conn: Connection, fences: Sequence[Fence], limits_table: Table,
                                limits: Sequence[Any], free: int, worker: str, token: str, lease: float,
                                queues: Sequence[str] | None, alone: bool,
                                plain: bool) -> tuple[set[int], list[Claimed], bool, bool, list[str]] | None:
        raw = conn.connection.driver_connection
        if not (getattr(raw, "autocommit", False) and hasattr(raw, "pipeline")):
            return None  # not the worker's autocommit psycopg 3 connection: the portable path
        hot = self._pg_hot_for(conn, queues)
        stmts = capped.statements(conn, self.jobs, limits_table, bool(queues), hot)
        pairs = ",".join(f"{job_id}:{job_token}" for job_id, job_token in fences)
        return capped.finish_and_claim_capped(conn, stmts, hot, pairs, sorted(limits, key=lambda lim: lim.kind),
                                                 free, worker, token, lease, queues, alone, plain)

    def _pg_hot_for(self, conn: Connection, queues: Sequence[str] | None) -> str:
        """The worker's claim statement skipping the limited kinds."""
        parted = partitions.is_partitioned(conn, self.jobs)
        return self._pg_hot[bool(queues), 1 | (2 if self.skip_queues else 0), parted, self.discard_finished, False]

    def insert_many(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """COPY, the fastest way in."""
        for columns, batch in self._insert_batches(rows):
            copy_rows(conn, self.jobs, columns, ([r[c] for c in columns] for r in batch))

    def insert_members(self, conn: Connection, rows: list[dict[str, Any]]) -> list[int]:
        """COPY too, with ids drawn from the table's sequence first (COPY returns none)."""
        ids = sorted(conn.scalars(text("SELECT nextval(pg_get_serial_sequence(:t, 'id')) FROM generate_series(1, :n)"),
                                  {"t": pg_name(self.jobs), "n": len(rows)}))
        for columns, batch in self._insert_batches([{**r, "id": i} for r, i in zip(rows, ids, strict=True)]):
            columns = ["id", "has_dependents", *columns]
            copy_rows(conn, self.jobs, columns, ([True if c == "has_dependents" else r[c] for c in columns]
                                                 for r in batch))
        return ids

    def add_edges(self, conn: Connection, rows: Sequence[tuple[int, int, int]]) -> None:
        """COPY too: a fan-in's 10,000 edges took a third of its flush as INSERTs."""
        copy_rows(conn, self.edges, ("downstream_id", "position", "upstream_id"), rows)

    def payload_value(self, text: str) -> ColumnElement[Any]:
        return cast(literal(text, Text()), JSONB())

    def insert_unique(self, conn: Connection, row: dict[str, Any]) -> int | None:
        if partitions.is_partitioned(conn, self.jobs):  # no unique index on the parent to conflict on
            return partitions.insert_unique(self, conn, row)
        return on_conflict_insert(self, conn, row, postgresql.insert)

    def upsert(self, conn: Connection, table: Table, row: dict[str, Any] | list[dict[str, Any]],
               update: Sequence[str] = ()) -> None:
        conn.execute(upsert_statement(postgresql.insert(table).values(row), table, update))

    def errors_plus(self, entry: dict[str, Any]) -> ColumnElement[Any]:
        return text("COALESCE(errors, '[]'::jsonb) || jsonb_build_array(CAST(:entry AS jsonb))").bindparams(
            entry=json.dumps(entry)
        )

    def skip_locked(self, stmt: Select[Any]) -> Select[Any]:
        return stmt.with_for_update(skip_locked=True)

    def prune_lock(self, conn: Connection) -> bool:
        key = zlib.crc32(f"sqla_jobs.prune.{self.jobs.fullname}".encode())
        return bool(conn.execute(select(func.pg_try_advisory_xact_lock(key))).scalar())

    def run_times(self, conn: Connection, window: float) -> list[tuple[str, int, float, float, float, float]]:
        t = self.jobs
        took = self.seconds_between(t.c.finished_at, t.c.locked_at)
        stmt = (
            select(
                t.c.kind,
                func.count().label("count"),
                func.avg(took).label("mean"),
                func.percentile_cont(0.5).within_group(took).label("p50"),
                func.percentile_cont(0.95).within_group(took).label("p95"),
                func.max(took).label("max"),
            )
            .where(self.recently_finished(window))
            .group_by(t.c.kind)
            .order_by(t.c.kind)
        )
        return [(r.kind, r.count, float(r.mean), float(r.p50), float(r.p95), float(r.max)) for r in conn.execute(stmt)]
