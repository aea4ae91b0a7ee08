"""Batches' statements: the batch table, a batch's callbacks and members, its counts (mixed into ``Driver``).

A batch is a row of ``<jobs>_batches`` (``id``, ``label``, ``created_at``,
``total``) naming up to three callback jobs. Each callback is a job graph
dependent (``drivers/_graph.py``) of every member: an edge per member and
callback, so the hand-off that ends the last member releases the callbacks in
its own transaction, like any dependent. What makes a callback a batch's is its
``on_upstream_failure``:

``on_complete``  ``run``      runs once every member has ended, however each ended
``on_success``   ``wait``     runs once every member has finished; a dead member holds it
                              until requeued (and finished) or purged (then it is cancelled)
``on_failure``   ``errback``  runs once every member has ended if one failed; cancelled
                              (skipped) when every member finished

The counts are read, not kept: a counter row updated by every member's finish
would make every worker of a big batch queue on one row lock. They come from the
edges of one callback (the *witness*: on_complete, else on_failure, else
on_success) joined to the jobs and dead-letter tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Column,
    Connection,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    case,
    false,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from ._setup import DatabaseNow, beside

__all__ = ["BATCH_SUFFIX", "CALLBACK_POLICIES", "ERRBACK", "Batches", "batch_table"]

#: The batch table is ``<jobs table>_batches``, in the jobs table's schema.
BATCH_SUFFIX = "_batches"
#: The ``on_upstream_failure`` of a batch's on_failure callback: run anyway, but only if an upstream failed.
ERRBACK = "errback"
#: Each callback's ``on_upstream_failure`` (see the module docstring), in witness order.
CALLBACK_POLICIES = {"on_complete": "run", "on_failure": ERRBACK, "on_success": "wait"}
_CALLBACKS = tuple(CALLBACK_POLICIES)


def batch_table(jobs: Table, metadata: MetaData | None = None) -> Table:
    """``<jobs>_batches`` beside ``jobs``: made in ``jobs``' metadata the first time, the same Table after.

    No foreign keys, for the reasons ``edge_table`` gives.
    """
    metadata, name, found = beside(jobs, BATCH_SUFFIX, metadata)
    if found is not None:
        return found
    return Table(
        name,
        metadata,
        Column("id", jobs.c.id.type, primary_key=True, autoincrement=True),  # INTEGER on SQLite: it numbers
        Column("label", String(255), nullable=True),
        Column("created_at", jobs.c.created_at.type, server_default=DatabaseNow(), nullable=False),
        #: How many members it has been given so far (each is an edge to every callback).
        Column("total", Integer, nullable=False, default=0),
        *(Column(f"{callback}_id", jobs.c.id.type, nullable=True) for callback in _CALLBACKS),
        *(Index(f"ix_{name}_{callback}", f"{callback}_id") for callback in _CALLBACKS),
        schema=jobs.schema,
    )


class Batches:
    """The statements of batches (see the module docstring)."""

    jobs: Table
    dead: Table

    if TYPE_CHECKING:  # Driver's own (declared here for the type checker only: Driver must win the MRO)
        @property
        def edges(self) -> Table: ...
        def now(self) -> ColumnElement[datetime]: ...

    @property
    def batches(self) -> Table:
        return batch_table(self.jobs)

    # -- making and growing a batch (sqla_jobs._batch) ----------------------------------------

    def insert_batch(self, conn: Connection, label: str | None) -> int:
        """A new batch row, without members or callbacks yet; its id."""
        result = conn.execute(insert(self.batches).values(label=label, total=0))
        return int(result.inserted_primary_key[0])

    def set_callbacks(self, conn: Connection, batch_id: int, callbacks: dict[str, int]) -> None:
        """Name the batch's callback jobs (``{"on_complete": id, ...}``), once they have ids."""
        b = self.batches
        conn.execute(update(b).where(b.c.id == batch_id).values({f"{name}_id": i for name, i in callbacks.items()}))

    def grow_batch(self, conn: Connection, batch_id: int, added: int) -> tuple[int, dict[int, str]] | None:
        """Count ``added`` members more into the batch; the first new member's position (the count before)
        and its callbacks' states by id, the callbacks locked for the caller's update; None for a batch
        that does not exist. The write comes first: it takes the batch row's lock (SQLite's write lock),
        so adders queue up here and a finish waits, or has committed, before the states are read."""
        b, t = self.batches, self.jobs
        if conn.execute(update(b).where(b.c.id == batch_id).values(total=b.c.total + added)).rowcount != 1:
            return None
        row = conn.execute(select(b).where(b.c.id == batch_id)).one()
        ids = [i for i in (getattr(row, f"{name}_id") for name in _CALLBACKS) if i is not None]
        states = dict(conn.execute(select(t.c.id, t.c.state).where(t.c.id.in_(ids)).with_for_update()).all())
        return int(row.total) - added, {i: states.get(i, "gone") for i in ids}

    def wait_for_more(self, conn: Connection, callbacks: Sequence[int], added: int) -> None:
        """Blocked callbacks wait for ``added`` members more (checked blocked under their locks: ``grow_batch``)."""
        t = self.jobs
        conn.execute(update(t).where(t.c.id.in_(list(callbacks)), t.c.state == "blocked")
                     .values(waiting_for=t.c.waiting_for + added))

    def insert_members(self, conn: Connection, rows: list[dict[str, Any]]) -> list[int]:
        """Insert checked ``enqueue_many`` rows as members (``has_dependents`` set); their ids, in ``rows``' order
        (a sequence links them in that order: ``sqla_jobs._sequence``)."""
        t = self.jobs
        ids: dict[int, int] = {}
        for columns, batch in self._insert_batches(rows):  # type: ignore[attr-defined]
            # The payload is bound as text, as ``insert_many`` does: it is JSON already.
            texts = {c: bindparam(c, type_=Text()) for c in ("payload", "trace_context") if c in columns}
            stmt = (insert(t).values(has_dependents=True, **texts)
                    .returning(t.c.id, sort_by_parameter_order=True))
            ids.update(zip(map(id, batch), conn.scalars(stmt, [{c: r[c] for c in columns} for r in batch]),
                           strict=True))
        return [ids[id(row)] for row in rows]

    # -- reading batches ------------------------------------------------------------------------

    def batch_row(self, conn: Connection, batch_id: int) -> Any:
        b = self.batches
        return conn.execute(select(b).where(b.c.id == batch_id)).first()

    def batch_of(self, conn: Connection, job_id: int) -> Any:
        """The batch ``job_id`` is a callback or a member of (the batch row), or None."""
        b, e = self.batches, self.edges
        mine = select(e.c.downstream_id).where(e.c.upstream_id == job_id).scalar_subquery()
        hits = [getattr(b.c, f"{name}_id") == job_id for name in _CALLBACKS]
        hits += [getattr(b.c, f"{name}_id").in_(mine) for name in _CALLBACKS]
        return conn.execute(select(b).where(or_(*hits)).order_by(b.c.id).limit(1)).first()

    def list_batches(self, conn: Connection, limit: int, before: int | None = None) -> list[Any]:
        """Batch rows, newest first, with their callbacks' states (``on_complete_state``, ...)."""
        b = self.batches
        callbacks = {name: self.jobs.alias(f"{name}_job") for name in _CALLBACKS}
        joined = b
        for name, job in callbacks.items():
            joined = joined.outerjoin(job, job.c.id == getattr(b.c, f"{name}_id"))
        stmt = select(b, *(job.c.state.label(f"{name}_state") for name, job in callbacks.items()))
        stmt = stmt.select_from(joined).order_by(b.c.id.desc()).limit(limit)
        if before is not None:
            stmt = stmt.where(b.c.id < before)
        return list(conn.execute(stmt))

    def callback_states(self, conn: Connection, row: Any) -> dict[str, tuple[int, str | None]]:
        """The batch's callbacks: name -> (job id, state; None once it left the jobs table)."""
        t = self.jobs
        ids = {name: getattr(row, f"{name}_id") for name in _CALLBACKS if getattr(row, f"{name}_id") is not None}
        found = dict(conn.execute(select(t.c.id, t.c.state).where(t.c.id.in_(list(ids.values())))).all())
        return {name: (i, found.get(i)) for name, i in ids.items()}

    def member_counts(self, conn: Connection, row: Any) -> dict[str, int]:
        """How the batch's members stand: ``waiting`` (not ended: pending, scheduled, blocked or running),
        ``finished``, ``dead`` (in the dead letters now), ``cancelled``, ``removed`` (in neither table: pruned
        or purged); read through the witness callback's edges."""
        witness = next((getattr(row, f"{name}_id") for name in _CALLBACKS if getattr(row, f"{name}_id")), None)
        counts = {"waiting": 0, "finished": 0, "dead": 0, "cancelled": 0, "removed": 0}
        if witness is None:
            return counts
        e, t, d = self.edges, self.jobs, self.dead
        how = case((t.c.state.in_(("finished", "cancelled")), t.c.state), (t.c.state.is_not(None), "waiting"),
                   (d.c.id.is_not(None), "dead"), else_="removed")
        stmt = (select(how.label("how"), func.count().label("n"))
                .select_from(e.outerjoin(t, t.c.id == e.c.upstream_id).outerjoin(d, d.c.id == e.c.upstream_id))
                .where(e.c.downstream_id == witness).group_by(how))
        for how_, n in conn.execute(stmt):
            counts[how_] = int(n)
        return counts

    def errback_skip(self, t: Table) -> ColumnElement[bool]:
        """A released on_failure callback none of whose upstreams failed: it is cancelled, not run.

        A CASE, not an AND: the edges are read only for a callback. ``policy = 'errback' AND NOT EXISTS (...)``
        reads them for every released job whose policy is NULL (NULL AND x needs x), and a join's edges are
        all of a fan-in's: once per job of each ``SET`` that tests it."""
        e = self.edges
        failed = select(e.c.downstream_id).where(e.c.downstream_id == t.c.id, e.c.ended.is_not(None)).exists()
        return case((t.c.on_upstream_failure == ERRBACK, ~failed), else_=false())
