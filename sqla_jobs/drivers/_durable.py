"""Durable jobs' statements: checkpointed steps, parked runs, events (mixed into ``Driver``).

Two tables beside the jobs table (``sqla_jobs._durable`` is the user's side):

* ``<jobs>_steps`` (``job_id``, ``name``): one row per step a job reached. A step that
  returned has ``finished_at`` and its ``value``; a sleep or a wait that parked the job has
  ``until`` (its due time, or the wait's deadline) and, for a wait, ``awaiting`` (the event
  key), and gets ``finished_at`` when a later run passes it;
* ``<jobs>_events`` (``key``): an event's ``data`` once ``emitted_at`` is set. A row with
  ``emitted_at`` NULL is a rendezvous: a job parked waiting for that key made it.

The rendezvous is what makes waiting race-free without a lock of its own. A parking run and
an emit both write the key's event row first (``park``: insert-or-ignore and a locking read;
``emit``: insert-or-ignore, then set it emitted): whichever commits second waited for the
first's row lock, so either the park reads the event emitted (the job is due at once), or the
emit's wake-up reads the parked step (the job is made due). An emit rolled back leaves the
row as it was.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Column,
    Connection,
    Index,
    MetaData,
    String,
    Table,
    and_,
    case,
    delete,
    exists,
    literal,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from ._claimed import Fence
from ._setup import beside

__all__ = ["EMIT_CHUNK", "EVENT_SUFFIX", "MAX_EVENT_KEY", "MAX_STEP_NAME", "STEP_SUFFIX", "Durable", "emit_statement",
           "event_table", "step_table", "upsert_statement"]

#: ``<jobs table>_steps`` and ``<jobs table>_events``, in the jobs table's schema.
STEP_SUFFIX = "_steps"
EVENT_SUFFIX = "_events"
#: Where ``emit`` remembers the transaction it notified in (the connection's ``info``).
_NOTIFIED = "sqla_jobs_durable_notified"
#: The longest step name and event key (characters).
MAX_STEP_NAME = 200
MAX_EVENT_KEY = 255
#: The most events one round of ``emit_many``'s statements writes: their keys and data are bound parameters,
#: and SQLite takes at most 32,766 in a statement (PostgreSQL 65,535).
EMIT_CHUNK = 5000


def holds_rows(conn: Connection, table: Table) -> bool:
    """Whether ``table`` has a row: a prune's clean-up of a feature's rows is skipped where nobody used it. (Each
    statement of it cost more than the prune's own DELETE, per id bound: 15 statements and 9,000 parameters a
    batch of 5,000, 160 ms against 15.)"""
    return conn.execute(select(literal(1)).select_from(table).limit(1)).first() is not None


def step_table(jobs: Table, metadata: MetaData | None = None) -> Table:
    """``<jobs>_steps`` beside ``jobs``: made in ``jobs``' metadata the first time, the same Table after.

    No foreign key, as for ``<jobs>_deps``: a job moves to the dead letters and back with its id (its
    steps wait for it there), and a partitioned jobs table has no primary key to point at.
    """
    metadata, name, found = beside(jobs, STEP_SUFFIX, metadata)
    if found is not None:
        return found
    stamp = jobs.c.run_at.type
    return Table(
        name,
        metadata,
        Column("job_id", jobs.c.id.type, primary_key=True, autoincrement=False),
        Column("name", String(MAX_STEP_NAME), primary_key=True),
        Column("value", jobs.c.result.type, nullable=True),
        #: A sleep's due time or a wait's deadline; NULL for a step.
        Column("until", stamp, nullable=True),
        #: The event key a parked wait waits for; NULL for anything else.
        Column("awaiting", String(MAX_EVENT_KEY), nullable=True),
        Column("started_at", stamp, nullable=True),
        Column("finished_at", stamp, nullable=True),
        Index(f"ix_{name}_awaiting", "awaiting"),
        schema=jobs.schema,
    )


def event_table(jobs: Table, metadata: MetaData | None = None) -> Table:
    """``<jobs>_events`` beside ``jobs``: made in ``jobs``' metadata the first time, the same Table after."""
    metadata, name, found = beside(jobs, EVENT_SUFFIX, metadata)
    if found is not None:
        return found
    stamp = jobs.c.run_at.type
    return Table(
        name,
        metadata,
        Column("key", String(MAX_EVENT_KEY), primary_key=True),
        Column("data", jobs.c.result.type, nullable=True),
        #: NULL: not emitted yet (a parked job waits for it).
        Column("emitted_at", stamp, nullable=True),
        Column("created_at", stamp, nullable=False),
        schema=jobs.schema,
    )


def upsert_statement(stmt: Any, table: Table, update: Sequence[str]) -> Any:
    """``INSERT ... ON CONFLICT (primary key) DO UPDATE SET`` the columns ``update`` (``DO NOTHING`` without
    any), for the dialects that spell it so (PostgreSQL, SQLite): ``stmt`` is their ``insert(table).values()``."""
    if not update:
        return stmt.on_conflict_do_nothing()
    return stmt.on_conflict_do_update(index_elements=list(table.primary_key.columns),
                                      set_={c: stmt.excluded[c] for c in update})


def emit_statement(stmt: Any, table: Table) -> Any:
    """``emit_rows`` in one statement for PostgreSQL and SQLite (``stmt``: their ``insert(events).values(rows)``):
    on a key's conflict, the row becomes the emitted event only while it is not one. It returns the keys
    this emit won, not those an earlier one had (a RETURNING: the driver's rowcount is -1 here)."""
    return stmt.on_conflict_do_update(index_elements=[table.c.key],
                                      set_={"data": stmt.excluded.data, "emitted_at": stmt.excluded.emitted_at},
                                      where=table.c.emitted_at.is_(None)).returning(table.c.key)


class Durable:
    """The statements of durable jobs (see the module docstring)."""

    jobs: Table
    #: How many events one round of ``emit_many``'s statements takes; None: all (PostgreSQL binds them as arrays).
    emit_chunk: int | None = EMIT_CHUNK
    #: How many ids one statement of a prune's clean-up matches (``id_chunks``); None: all (PostgreSQL: one array).
    id_chunk: int | None = 1000

    if TYPE_CHECKING:  # Driver's own (declared here for the type checker only: Driver must win the MRO)
        def now(self) -> ColumnElement[datetime]: ...
        def notify(self, conn: Connection) -> None: ...
        def fenced(self, fences: Sequence[Fence]) -> ColumnElement[bool]: ...

    @property
    def steps(self) -> Table:
        return step_table(self.jobs)

    @property
    def events(self) -> Table:
        return event_table(self.jobs)

    def upsert(self, conn: Connection, table: Table, row: dict[str, Any] | list[dict[str, Any]],
               update: Sequence[str] = ()) -> None:
        """Insert ``row`` (or each of a list of rows, in one statement); if its primary key is taken (waiting for an
        uncommitted row with that key), set the columns ``update`` to ``row``'s values instead, or leave the row as
        it is. Each backend's own."""
        raise NotImplementedError

    # -- a run's steps --------------------------------------------------------------------

    def jobs_steps(self, conn: Connection, job_ids: Sequence[int]) -> dict[int, list[Any]]:
        """``job_steps`` of several jobs in one statement, by job id (a job without steps is left out)."""
        s = self.steps
        found: dict[int, list[Any]] = {}
        for row in conn.execute(self._step_rows().add_columns(s.c.job_id).where(s.c.job_id.in_(job_ids))
                                .order_by(s.c.job_id, s.c.started_at, s.c.name)):
            found.setdefault(row.job_id, []).append(row)
        return found

    def _step_rows(self) -> Any:
        """The columns a run and a person read of a step (``job_steps``, ``jobs_steps``)."""
        s = self.steps
        return select(s.c.name, s.c.value, s.c.until, s.c.awaiting, s.c.started_at, s.c.finished_at)

    def job_steps(self, conn: Connection, job_id: int) -> list[Any]:
        """A job's step rows (``name``, ``value``, ``until``, ``awaiting``, ``started_at``, ``finished_at``),
        in the order they were started."""
        s = self.steps
        return list(conn.execute(self._step_rows().where(s.c.job_id == job_id).order_by(s.c.started_at, s.c.name)))

    def save_step(self, conn: Connection, job_id: int, name: str, value: Any, started: datetime,
                  finished: datetime) -> None:
        """A step (or a passed sleep or wait) is done: its value and times, over a parked row if there is one."""
        row = {"job_id": job_id, "name": name, "value": value, "until": None, "awaiting": None, "started_at": started,
               "finished_at": finished}
        self.upsert(conn, self.steps, row, ("value", "awaiting", "finished_at"))

    def park(self, conn: Connection, job_id: int, name: str, until: datetime, started: datetime,
             key: str | None) -> bool:
        """Record that a run parked at the sleep or wait ``name`` until ``until`` (waiting for ``key``, if
        given), in the transaction that hands the job back. Returns True when ``key`` was emitted already
        (then nothing waits: the job should be due now)."""
        if key is not None:
            e = self.events
            self.upsert(conn, e, {"key": key, "data": None, "emitted_at": None, "created_at": self.now()})
            emitted = conn.execute(select(e.c.emitted_at).where(e.c.key == key).with_for_update()).scalar()
            if emitted is not None:
                return True
        row = {"job_id": job_id, "name": name, "value": None, "until": until, "awaiting": key, "started_at": started,
               "finished_at": None}
        self.upsert(conn, self.steps, row, ("until", "awaiting"))
        return False

    def hold(self, conn: Connection, fence: Fence) -> bool:
        """Lock the running job ``fence`` until the caller's transaction ends; whether it is still ours (a
        transactional handler that parks commits its steps under this, fenced like a finish)."""
        t = self.jobs
        return conn.execute(update(t).where(self.fenced([fence])).values(locked_at=t.c.locked_at)).rowcount == 1

    def end_parks(self, conn: Connection, kind: str | None, now: datetime) -> int:
        """Tests (``sqla_jobs.testing.make_due``): the sleeps and waits of the parked jobs (pending, due later;
        of ``kind`` if given) end at ``now``, so their next run passes them (a wait with None). Call it before
        their ``run_at`` moves. Returns how many ended."""
        s, t = self.steps, self.jobs
        parked = select(t.c.id).where(t.c.state == "pending", t.c.run_at > self.now())
        if kind is not None:
            parked = parked.where(t.c.kind == kind)
        ids = list(conn.scalars(parked))
        ended = 0
        for start in range(0, len(ids), 1000):
            ended += conn.execute(update(s).where(s.c.job_id.in_(ids[start:start + 1000]), s.c.finished_at.is_(None),
                                                  s.c.until.is_not(None)).values(until=now)).rowcount
        return ended

    def open_connections(self, conn: Connection) -> int | None:
        """How many connections the server has open to this database (``bench --durable``: parked jobs hold
        none); None where there is no server to ask."""
        return None

    def forget_steps(self, conn: Connection, job_ids: Sequence[int]) -> None:
        """Pruned jobs take their steps with them (nothing to ask when no job has a step)."""
        s = self.steps
        if holds_rows(conn, s):
            for chunk in self.id_chunks(job_ids):
                conn.execute(delete(s).where(self.among_ids(s.c.job_id, chunk)))

    def id_chunks(self, ids: Collection[int]) -> list[list[int]]:
        """``ids`` in rounds of ``id_chunk``, for ``among_ids``."""
        ordered = sorted(set(ids))
        size = self.id_chunk or max(len(ordered), 1)
        return [ordered[start:start + size] for start in range(0, len(ordered), size)]

    def among_ids(self, column: ColumnElement[int], ids: Collection[int]) -> ColumnElement[bool]:
        """``column`` is one of ``ids``: ``IN`` a bound parameter each (PostgreSQL: ``= ANY`` of one array)."""
        return column.in_(list(ids))

    # -- events -----------------------------------------------------------------------------

    def event(self, conn: Connection, key: str) -> Any:
        """The emitted event ``key`` (``data``, ``emitted_at``), or None."""
        e = self.events
        return conn.execute(select(e.c.data, e.c.emitted_at)
                            .where(e.c.key == key, e.c.emitted_at.is_not(None))).first()

    def emit(self, conn: Connection, key: str, data: Any) -> int | None:
        """``emit_many`` of one event: None if ``key`` was emitted before (the first emit wins, this one changes
        nothing), else how many parked jobs it made due."""
        won, woken = self.emit_many(conn, {key: data})
        return woken if won else None

    def emit_many(self, conn: Connection, events: dict[str, Any]) -> tuple[set[str], int]:
        """Emit each event (``key: data``) in the caller's transaction unless its key was emitted before: the keys
        this call emitted, and how many parked jobs they made due now (they run when this transaction commits;
        listening workers are woken then). A few statements for up to ``emit_chunk`` events, whatever their number:
        the event rows, the wake-up, the waits' answers (and one NOTIFY per transaction on PostgreSQL)."""
        won: set[str] = set()
        woken = 0
        items = list(events.items())
        chunk = self.emit_chunk or max(len(items), 1)
        for start in range(0, len(items), chunk):
            keys = self.emit_rows(conn, dict(items[start:start + chunk]))
            count = self.wake_waiting(conn, keys) if keys else 0
            if count:
                self.answer_waiting(conn, keys)
            won |= keys
            woken += count
        # One NOTIFY per transaction is enough (PostgreSQL folds identical ones at commit anyway): 10,000 emits
        # in one transaction are 10,000 round trips fewer.
        transaction = conn.get_transaction()
        if woken and conn.info.get(_NOTIFIED) is not transaction:
            self.notify(conn)
            conn.info[_NOTIFIED] = transaction
        return won, woken

    def emit_rows(self, conn: Connection, events: dict[str, Any]) -> set[str]:
        """Write each event (``key: data``) emitted unless its key was emitted before; the keys this call emitted.
        Three statements: the keys' rows made where missing (a park's rendezvous row may be there), a locking read
        of those not emitted yet, and those set emitted (PostgreSQL and SQLite do it in one ``INSERT ... ON
        CONFLICT DO UPDATE ... WHERE``)."""
        e = self.events
        now = self.now()
        self.upsert(conn, e, [{"key": key, "data": None, "emitted_at": None, "created_at": now} for key in events])
        won = set(conn.scalars(select(e.c.key).where(e.c.key.in_(list(events)), e.c.emitted_at.is_(None))
                               .with_for_update()))
        if won:
            self.upsert(conn, e, [{"key": key, "data": data, "emitted_at": now, "created_at": now}
                                  for key, data in events.items() if key in won], ("data", "emitted_at"))
        return won

    def among(self, column: ColumnElement[str], keys: Collection[str]) -> ColumnElement[bool]:
        """``column`` is one of ``keys``: ``IN`` a bound parameter each (PostgreSQL: ``= ANY`` of one array)."""
        return column == next(iter(keys)) if len(keys) == 1 else column.in_(list(keys))

    def wake_waiting(self, conn: Connection, keys: Collection[str]) -> int:
        """The jobs parked waiting for any of ``keys`` become due now; how many. One statement: its subquery reads
        the parked steps committed before it started, which includes any park this emit's row locks waited for
        (MariaDB/MySQL, whose REPEATABLE READ would read its snapshot, override it with a locking read)."""
        t = self.jobs
        now = self.now()
        return conn.execute(update(t).where(self.waiting_jobs(keys), t.c.state == "pending")
                            .values(run_at=case((t.c.run_at > now, now), else_=t.c.run_at))).rowcount

    def waiting_jobs(self, keys: Collection[str]) -> ColumnElement[bool]:
        """A job of the jobs table has an open wait for one of ``keys`` (a subquery of the steps)."""
        s = self.steps
        return self.jobs.c.id.in_(select(s.c.job_id).where(self.among(s.c.awaiting, keys), s.c.finished_at.is_(None)))

    def parked_waits(self, keys: Collection[str]) -> ColumnElement[bool]:
        """A step is an open wait for one of ``keys`` of a job still parked (pending)."""
        s, t = self.steps, self.jobs
        return and_(self.among(s.c.awaiting, keys), s.c.finished_at.is_(None),
                    exists().where(t.c.id == s.c.job_id, t.c.state == "pending"))

    def answer_waiting(self, conn: Connection, keys: Collection[str]) -> None:
        """The parked waits for ``keys`` end with their events' data (just written, read back in the same statement),
        in the emit's transaction: each woken job's re-run finds its wait passed in the steps it reads anyway, instead
        of reading the event and storing the step itself (two round trips a job: most of the cost of resuming 10,000
        waiters). Only the waits of jobs still parked (pending): a job already running again (its timeout came)
        decides its wait itself."""
        s, e = self.steps, self.events
        data = select(e.c.data).where(e.c.key == s.c.awaiting).scalar_subquery()
        conn.execute(update(s).where(self.parked_waits(keys)).values(value=data, finished_at=self.now()))

    def waiting_for(self, conn: Connection, key: str) -> list[int]:
        """The jobs parked waiting for ``key``, by id."""
        s = self.steps
        return list(conn.scalars(select(s.c.job_id).where(s.c.awaiting == key, s.c.finished_at.is_(None))
                                 .order_by(s.c.job_id)))

    def prune_events(self, conn: Connection, before: datetime) -> int:
        """Delete the events emitted before ``before``, and rendezvous rows made before it that no job
        waits on any more. Returns how many."""
        e, s = self.events, self.steps
        waited = select(s.c.awaiting).where(s.c.awaiting.is_not(None), s.c.finished_at.is_(None))
        stale = ((e.c.emitted_at < before)
                 | (e.c.emitted_at.is_(None) & (e.c.created_at < before) & e.c.key.not_in(waited)))
        return conn.execute(delete(e).where(stale)).rowcount
