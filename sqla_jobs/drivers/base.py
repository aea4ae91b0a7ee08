"""The statements every backend shares, written once with SQLAlchemy Core.

A backend module subclasses :class:`Driver` and fills in what its database
does differently (see the package docstring for the list). Everything here is
portable Core against the user's own tables, so custom table names and
schemas need no special case.

Two rules hold for every write a worker makes after claiming:

* it is *fenced*: it names both the job id and the claim token it got at
  claim time, and the ``state = 'running'`` it expects, so a worker that lost
  its claim (lease expired, job re-claimed elsewhere) changes nothing;
* time comes from the database clock (:meth:`Driver.now`), never from the
  worker's, so lease arithmetic is right even when hosts disagree.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    insert,
    inspect,
    tuple_,
    update,
)
from sqlalchemy.schema import CreateIndex
from sqlalchemy.sql.elements import ColumnElement

from ._batches import Batches
from ._claimed import DEAD_COLUMNS, AsyncListener, Claimed, Fence, Listener
from ._durable import Durable
from ._endings import Endings
from ._fair import Fairness
from ._graph import Graph
from ._operations import MAX_ERROR_LENGTH, Operations, truncate
from ._percentile import percentile, run_times_in_python
from ._results import Flow
from ._sequences import Sequences
from ._setup import DatabaseNow, IndexDefinition, Setup, index_dialects
from ._transactions import OpenTransactions
from ._unique import Uniqueness

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "DEAD_COLUMNS",
    "MAX_ERROR_LENGTH",
    "AsyncListener",
    "Claimed",
    "DatabaseNow",
    "Driver",
    "Fence",
    "IndexDefinition",
    "Listener",
    "index_dialects",
    "percentile",
    "run_times_in_python",
    "truncate",
]

_SEQUENCED = ("sequence_key", "state", "waiting_for", "on_upstream_failure")


# Sequences before Operations: its ``cancel`` splices a sequence, then runs the plain one.
class Driver(Setup, Sequences, Operations, Uniqueness, Flow, Endings, Graph, Batches, Durable, Fairness,
             OpenTransactions):
    """The statements for one pair of tables on one backend.

    Subclasses set ``name`` (SQLAlchemy's dialect name) and ``label`` and
    implement the abstract methods; capability properties default to the
    plainest backend (no LISTEN, no COPY, every write in a transaction).
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    #: Other backend or dialect names for this database (``postgres://``; ``mysql`` beside ``mariadb``).
    url_aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, jobs: Table, dead: Table, dbapi: str | None = None) -> None:
        self.jobs = jobs
        self.dead = dead
        #: The DBAPI module's name as SQLAlchemy knows it (``psycopg``, ``pysqlite``), when known.
        self.dbapi = dbapi
        #: Finishing deletes the job instead of keeping it ``finished``: set on a worker's own copy
        #: (``discarding_finished``) when it keeps no finished jobs (``prune_after=0``).
        self.discard_finished = False
        #: Queues the plain claim leaves out: fair queues, claimed by ``claim_fair`` (set on a worker's own copy).
        self.skip_queues: list[str] = []

    def discarding_finished(self) -> Driver:
        """A copy of this driver whose ``finish`` (and fused finish-and-claim) deletes the jobs it finishes.

        For a worker run with ``prune_after=0``: a finished row it would prune at once is never
        written. One ``DELETE`` costs the server less than the ``UPDATE`` it replaces: no new row
        version, no index entries, less to vacuum. The copy is the worker's alone; the app's
        driver (admin, stats, other workers) is unchanged.
        """
        discarding = copy.copy(self)
        discarding.discard_finished = True
        return discarding

    def skipping_queues(self, names: Sequence[str]) -> Driver:
        """A copy of this driver whose plain claim leaves out the queues ``names`` (a worker's fair queues)."""
        skipping = copy.copy(self)
        skipping.skip_queues = sorted(names)
        return skipping

    # -- capabilities ----------------------------------------------------------

    @property
    def supports_listen(self) -> bool:
        """Workers can wait for new jobs on a notification channel instead of polling."""
        return False

    @property
    def supports_copy(self) -> bool:
        """``insert_many`` streams rows with a bulk-load protocol."""
        return False

    @property
    def hot_isolation(self) -> str | None:
        """The isolation level of the worker's one long-lived connection for its short writes (claim,
        finish, heartbeat), e.g. ``"AUTOCOMMIT"``; None: each of them is a ``write`` transaction instead."""
        return None

    @property
    def channel(self) -> str:
        """The notification channel of the jobs table ("" where there is none)."""
        return ""

    def listener(self, engine: Engine, wake: Callable[[], None], worker_name: str) -> Listener | None:
        """Something to ``start()`` and ``stop()`` that calls ``wake`` when a job is enqueued, or None
        where the database cannot notify (``supports_listen``); the worker then polls."""
        return None

    def async_listener(self, engine: AsyncEngine, wake: Callable[[], None], worker_name: str) -> AsyncListener | None:
        """``listener`` for the async worker: started from its event loop's thread, it calls ``wake`` there
        (no thread between the database and the loop), and ``await stop()`` closes its connection."""
        return None

    # -- time -------------------------------------------------------------------

    def now(self) -> ColumnElement[datetime]:
        """The database clock."""
        raise NotImplementedError

    def later(self, seconds: float) -> ColumnElement[datetime]:
        """The database clock plus ``seconds`` (may be negative)."""
        raise NotImplementedError

    def ago(self, seconds: float) -> ColumnElement[datetime]:
        """The database clock ``seconds`` ago."""
        return self.later(-seconds)

    def seconds_between(self, later: Any, earlier: Any) -> ColumnElement[float]:
        """``later - earlier`` in seconds, as a float, computed by the database."""
        raise NotImplementedError

    def server_uptime(self, conn: Connection) -> float | None:
        """Seconds since the database server started; None where there is no server (SQLite).

        The lease reaper waits after a start (``expired``'s ``settle``): an outage stops every
        worker's heartbeats, so right after it every lease looks run out although its worker lives.
        """
        return None

    # -- transactions and schema ------------------------------------------------

    @contextmanager
    def write(self, engine: Engine) -> Iterator[Connection]:
        """A short write transaction (see :meth:`begin_write`)."""
        with engine.connect() as conn:
            self.begin_write(conn)
            try:
                yield conn
            except BaseException:
                conn.rollback()
                raise
            conn.commit()

    def begin_write(self, conn: Connection) -> None:
        """Start a write transaction the backend needs started specially (nothing by default)."""

    def prepare(self, engine: Engine) -> None:
        """One-time settings before a worker starts (nothing by default)."""

    def create(self, conn: Connection) -> None:
        """Create what is missing: both tables and their indexes (and whatever the backend adds).

        Tables made by an older sqla-jobs get the indexes added since; their
        columns are left alone (that takes a migration).
        """
        for table in (self.jobs, self.dead, self.edges, self.batches, self.steps, self.events, self.sequences):
            table.create(conn, checkfirst=True)
            for index in self.creatable_indexes(conn, table):
                conn.execute(CreateIndex(index, if_not_exists=True))

    def creatable_indexes(self, conn: Connection, table: Table) -> list[Any]:
        """The table's indexes for this backend whose columns exist: an index over a column a newer
        sqla-jobs added waits for the migration that adds the column (``check_schema`` asks for it)."""
        have = {c["name"] for c in inspect(conn).get_columns(table.name, schema=table.schema)}
        return [ix for ix in table.indexes if self.applies(ix) and {c.name for c in ix.columns} <= have]

    def has_notify_trigger(self, conn: Connection) -> bool:
        """Whether inserts into the jobs table wake workers (False where workers always poll)."""
        return False

    def notify(self, conn: Connection) -> None:
        """Wake the workers waiting on the jobs table when this transaction commits (where they wait)."""

    def index_names(self, conn: Connection) -> set[str]:
        """The names of the jobs table's indexes in the database."""
        t = self.jobs
        return {ix["name"] for ix in inspect(conn).get_indexes(t.name, schema=t.schema) if ix["name"]}

    # -- the worker's path -----------------------------------------------------

    def claim(
        self,
        conn: Connection,
        limit: int,
        worker: str,
        token: str,
        lease: float,
        queues: Sequence[str] | None,
        *,
        alone: bool = False,
        skip_kinds: Sequence[str] = (),
    ) -> list[Claimed]:
        """Claim up to ``limit`` due jobs, returned in claim order (most urgent, then oldest, first).

        Isolated jobs follow ``finish_and_claim``'s rule.
        """
        return self.claim_batch(conn, limit, worker, token, lease, queues, alone, skip_kinds)[0]

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
        """The claim itself: (claimed in claim order, isolated_waiting); see ``finish_and_claim``."""
        raise NotImplementedError

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
        """Mark ``fences`` finished and claim up to ``limit`` due jobs (none of ``skip_kinds``).

        Returns (finished ids, claimed, isolated_waiting). The worker's hot path;
        by default a few statements in the caller's transaction. Jobs marked
        ``isolate`` are claimed only with ``alone`` (the worker runs nothing), one
        at a time and with nothing else; ``isolated_waiting`` says such a job was
        among the most urgent ``limit`` and was left, so the worker should drain
        and claim alone. ``skip_kinds``: kinds with limits, which ``drivers._limits.claim_limited`` claims.
        ``upstreams``: the ids among ``fences`` the worker knows others depend on (``Claimed.has_dependents``);
        here ``finish`` counts every finished job's dependents down, so they need no special path.
        """
        # The finish first: a dependent it unblocks (drivers/_graph.py) is then claimable by this very claim.
        finished = self.finish(conn, fences)
        claimed, waiting = self.claim_batch(conn, limit, worker, token, lease, queues, alone, skip_kinds)
        return finished, claimed, waiting

    def insert_many(self, conn: Connection, rows: list[dict[str, Any]]) -> None:
        """Insert validated rows (payload already JSON text) in the caller's transaction.

        Rows without ``run_at`` get the database clock, like ``Job(...)`` does.
        """
        for columns, batch in self._insert_batches(rows):
            # The payload (and a trace context) is bound as text: it is JSON already, no second encoding.
            texts = {c: bindparam(c, type_=Text()) for c in ("payload", "trace_context") if c in columns}
            stmt = insert(self.jobs).values(**texts)
            conn.execute(stmt, [{c: r[c] for c in columns} for r in batch])

    @staticmethod
    def _insert_batches(rows: list[dict[str, Any]]) -> Iterator[tuple[list[str], list[dict[str, Any]]]]:
        """The rows in batches of the same columns: with a ``run_at`` or without; with a ``trace_context`` (JSON
        text or None) or a ``fair_key`` when the rows have that key (``enqueue_many`` gives each to all of a call's
        rows or none)."""
        # A sequenced row (sqla_jobs._sequence) has its key, its state and count, and its policy too.
        extra = [c for c in ("trace_context", "fair_key", *_SEQUENCED) if rows and c in rows[0]]
        for timed in (False, True):
            batch = [r for r in rows if (r["run_at"] is not None) is timed]
            if batch:
                yield ["kind", "queue", "payload", "priority", "max_attempts", *(["run_at"] if timed else []),
                       *extra], batch

    def fenced(self, fences: Iterable[Fence]) -> ColumnElement[bool]:
        t = self.jobs
        return and_(tuple_(t.c.id, t.c.claim_token).in_(list(fences)), t.c.state == "running")

    def skip_locked(self, stmt: Select[Any]) -> Select[Any]:
        """``stmt`` made to pass over rows other sessions hold locked (as is, where rows are not locked)."""
        return stmt

    def by_state(self, stmt: Select[Any]) -> Select[Any]:
        """``stmt``, the newest jobs of one state (a branch of the dashboard's lists: drivers/_dashboard.py), read
        through an index of that state rather than backwards along the primary key, where the planner would not
        choose so itself."""
        return stmt

    def claim_capped(self, conn: Connection, limits: Table, row: str, kind: str, running: int, budget: int,
                     worker: str, token: str, lease: float, queues: Sequence[str] | None,
                     alone: bool) -> tuple[list[Claimed], bool] | None:
        """A kind with a plain running limit claimed the backend's faster way (``drivers._limits``), or None:
        the portable path runs (here always; on PostgreSQL ``pg_limits``)."""
        return None

    def finish_and_claim_capped(self, conn: Connection, fences: Sequence[Fence], limits_table: Table,
                                limits: Sequence[Any], free: int, worker: str, token: str, lease: float,
                                queues: Sequence[str] | None, alone: bool,
                                plain: bool) -> tuple[set[int], list[Claimed], bool, bool, list[str]] | None:
        """The worker's finishes and claims when every limit is a plain running limit, on its hot
        connection, the backend's faster way; None: ``Store`` takes its portable path (here always)."""
        return None

    def heartbeat(self, conn: Connection, fences: Sequence[Fence], lease: float) -> set[Fence]:
        """Extend the leases still held; returns those (the rest were lost)."""
        if not fences:
            return set()
        t = self.jobs
        stmt = update(t).where(self.fenced(fences)).values(lease_expires_at=self.later(lease))
        return {(r.id, r.claim_token) for r in conn.execute(stmt.returning(t.c.id, t.c.claim_token))}
