"""Job graphs' statements: the edge table, passing an upstream's end on to its dependents (mixed into ``Driver``).

A dependency is a row of ``<jobs>_deps`` (``downstream_id``, ``position``,
``upstream_id``); a job with upstreams that have not ended is ``blocked`` and
counts them in ``waiting_for``; a job some other job depends on has
``has_dependents`` set. What an upstream's end *means* for its dependents is
the outcome policy's (``sqla_jobs/worker/outcomes.py``, ``on_upstream_end``);
these are the acts, each in the caller's transaction, so the hand-off commits
with the end that caused it or not at all:

* ``unblock``: upstreams finished: each dependent's count goes down by its edges
  from them, and a dependent whose count reaches 0 becomes ``pending`` (and the
  workers are woken);
* ``blocked_dependents`` / ``cancel_dependents`` / ``count_as_done``: an upstream
  was dead-lettered, cancelled or purged, and its dependents are cancelled, run
  anyway, or left waiting;
* ``lock_upstreams`` / ``add_edges``: a new dependent's flush (``sqla_jobs._graph``).

An edge whose upstream's failure was already passed on is marked (``ended``), so a
requeued upstream that later finishes never counts twice for the same dependent.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Column,
    Connection,
    Index,
    Integer,
    MetaData,
    Select,
    String,
    Table,
    and_,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from ._batches import ERRBACK, batch_table
from ._durable import holds_rows
from ._operations import truncate
from ._setup import beside

__all__ = ["EDGE_SUFFIX", "FAILURE_POLICIES", "SKIPPED", "Graph", "edge_table", "on_upstream_failure"]

#: The edge table is ``<jobs table>_deps``, in the jobs table's schema.
EDGE_SUFFIX = "_deps"

#: Edges per statement when a flush writes them (well under every backend's parameter limit).
_EDGE_BATCH = 5000


def edge_table(jobs: Table, metadata: MetaData | None = None) -> Table:
    """``<jobs>_deps`` beside ``jobs``: made in ``jobs``' metadata the first time, the same Table after.

    No foreign keys: a job leaves the jobs table for the dead letters and comes back with its id, is
    pruned or purged, and a partitioned jobs table has no primary key to point at. The statements here
    keep the rows consistent instead. The ids have the jobs table's id type (and its backend variants).
    """
    metadata, name, found = beside(jobs, EDGE_SUFFIX, metadata)
    if found is not None:
        return found
    return Table(
        name,
        metadata,
        Column("downstream_id", jobs.c.id.type, primary_key=True, autoincrement=False),
        #: The upstream's place in the dependent's ``depends_on`` (``upstream_results()`` keeps that order).
        Column("position", Integer, primary_key=True, autoincrement=False),
        Column("upstream_id", jobs.c.id.type, nullable=False),
        #: How the upstream ended when its end was passed on as a failure (dead, cancelled, purged); else NULL.
        Column("ended", String(16), nullable=True),
        Index(f"ix_{name}_upstream", "upstream_id"),
        schema=jobs.schema,
    )


#: What a blocked dependent may do when an upstream fails (``Job(on_upstream_failure=...)``; None is the first).
FAILURE_POLICIES = ("cancel", "run", "wait", "hold")
#: The reason a skipped on_failure callback is given (every upstream finished).
SKIPPED = "skipped: every member of the batch finished, so on_failure is not needed"
#: How an upstream can fail, as the reason a cancelled dependent is given.
_FAILED = {"dead": "was dead-lettered", "cancelled": "was cancelled", "purged": "was purged from the dead letters"}


def on_upstream_failure(policy: str | None, ended: str) -> str:
    """What a blocked dependent with ``policy`` does when an upstream ended ``ended`` (dead, cancelled,
    purged): ``cancel`` it, ``run`` (count the upstream as done), or ``wait`` (a requeue of the dead
    upstream resumes it). Only a dead upstream can come back, so ``wait`` cancels on the other two:
    nothing would ever release the dependent. ``hold`` (a sequence's default, ``sqla_jobs._sequence``)
    waits for a dead upstream too, but runs once it is purged or cancelled: that job left on purpose."""
    if policy in ("run", ERRBACK) or (policy == "hold" and ended != "dead"):
        return "run"
    if policy in ("wait", "hold") and ended == "dead":
        return "wait"
    return "cancel"


class Graph:
    """The statements of job graphs (see the module docstring)."""

    jobs: Table
    dead: Table

    if TYPE_CHECKING:  # Driver's own (declared here for the type checker only: Driver must win the MRO)
        def now(self) -> ColumnElement[datetime]: ...
        def notify(self, conn: Connection) -> None: ...
        def errback_skip(self, t: Table) -> ColumnElement[bool]: ...
        def id_chunks(self, ids: Collection[int]) -> list[list[int]]: ...
        def among_ids(self, column: ColumnElement[int], ids: Collection[int]) -> ColumnElement[bool]: ...

    @property
    def edges(self) -> Table:
        return edge_table(self.jobs)

    # -- a new dependent's flush -------------------------------------------------------------

    def lock_upstreams(self, conn: Connection, ids: Sequence[int]) -> dict[int, tuple[str, str | None]]:
        """Mark existing jobs as having dependents, under their row locks; their states and
        ``on_upstream_failure``, by id.

        The lock is what makes the hand-off race-free: a worker finishing one of them waits for
        this transaction, and its ``unblock`` (a later statement of its transaction) then sees the
        new edges; or this waits for the worker, and then reads the job finished. Ids missing from
        the result are not in the jobs table (dead-lettered, pruned, or never existed).
        """
        t = self.jobs
        states: dict[int, tuple[str, str | None]] = {}
        for chunk in _chunks(sorted(set(ids))):
            # The write first: on SQLite it takes the database's write lock before the states are read (a read
            # first let a worker commit a finish in between); on the servers it locks the rows it marks. The
            # read is a locking one, so MariaDB's REPEATABLE READ reads the latest rows, not its snapshot.
            conn.execute(update(t).where(t.c.id.in_(chunk), t.c.state.not_in(("finished", "cancelled")))
                         .values(has_dependents=True))
            rows = conn.execute(select(t.c.id, t.c.state, t.c.on_upstream_failure).where(t.c.id.in_(chunk))
                                .with_for_update())
            states.update({r.id: (r.state, r.on_upstream_failure) for r in rows})
        return states

    def dead_ids(self, conn: Connection, ids: Sequence[int]) -> set[int]:
        """Which of ``ids`` are in the dead-letter table."""
        d = self.dead
        found: set[int] = set()
        for chunk in _chunks(sorted(set(ids))):
            found.update(conn.scalars(select(d.c.id).where(d.c.id.in_(chunk))))
        return found

    def add_edges(self, conn: Connection, rows: Sequence[tuple[int, int, int]]) -> None:
        """Insert edges, each ``(downstream_id, position, upstream_id)``."""
        for chunk in _chunks(list(rows), _EDGE_BATCH):
            conn.execute(insert(self.edges),
                         [{"downstream_id": d, "position": p, "upstream_id": u} for d, p, u in chunk])

    # -- an upstream ended -------------------------------------------------------------------

    def unblock(self, conn: Connection, finished: Iterable[int]) -> int:
        """Upstreams ``finished`` (or counted as if): their blocked dependents' counts go down, those at 0
        become ``pending``, and listening workers are woken. Returns how many dependents were counted down."""
        ids = sorted(set(finished))
        if not ids:
            return 0
        e = self.edges
        touched = 0
        for chunk in _chunks(ids):
            # Each dependent's share of these upstreams, counted once through the upstream index (a
            # correlated count per dependent read a wide fan-in's every edge, for every dependent).
            gone = (select(e.c.downstream_id.label("id"), func.count().label("n"))
                    .where(e.c.upstream_id.in_(chunk), e.c.ended.is_(None))
                    .group_by(e.c.downstream_id).subquery("gone"))
            touched += self._count_down(conn, gone, select(e.c.downstream_id).where(e.c.upstream_id.in_(chunk)))
        if touched:
            self.notify(conn)
        return touched

    def _count_down(self, conn: Connection, gone: Any, among: Any) -> int:
        """The counts of ``gone`` (id, n) go down, and a blocked job whose count reaches 0 is released in the same
        ``UPDATE``: every ``SET`` of it reads the row as it was (PostgreSQL, SQLite), so the release sees the old
        count. One pass over the dependents, not two: a fan-out's root releases 100,000 of them, and each pass
        writes a new version of every row. MariaDB/MySQL give a joined ``UPDATE``'s ``SET``s no order: two
        statements there (``drivers/mysql``).

        ``among`` (the dependents' edges) is for the two-statement form: a blocked job's count is never 0 between
        transactions, so only the counted-down jobs can be released."""
        t = self.jobs
        left = t.c.waiting_for - gone.c.n
        return conn.execute(update(t).where(t.c.id == gone.c.id, t.c.state == "blocked")
                            .values(waiting_for=left, **self._released(left <= 0))).rowcount

    def _release(self, conn: Connection, among: Select[Any]) -> None:
        """Blocked jobs ``among`` the dependents this query of edges names, at 0, are released (``_released``)."""
        t = self.jobs
        # Joined, not `id IN (query)`: MariaDB 10 cannot semi-join in a single-table UPDATE, so it read every row of
        # the jobs table and asked the query for each (34 ms a batch of finishes beside 20,000 jobs: a fan-in
        # drained at half the plain rate). The join starts from the edges' few rows.
        released = among.distinct().subquery("released")
        conn.execute(update(t).where(t.c.id == released.c.downstream_id, t.c.state == "blocked",
                                     t.c.waiting_for <= 0).values(**self._released()))

    def _released(self, due: ColumnElement[bool] | None = None) -> dict[str, Any]:
        """The ``SET`` of a blocked job released: ``pending``, due from now at the latest (it waited for upstreams,
        not in the queue: its age as a pending job starts now); a batch's on_failure callback none of whose
        upstreams failed is cancelled instead (``drivers/_batches.py``: it has no dependents of its own). With
        ``due``, only where it holds; elsewhere the row stays as it is, ``blocked``."""
        t = self.jobs
        now, skip = self.now(), self.errback_skip(t)

        def where_due(condition: ColumnElement[bool], value: Any, otherwise: Any) -> ColumnElement[Any]:
            return case((condition if due is None else and_(due, condition), value), else_=otherwise)

        # Nested, so a callback's edges (errback_skip) are read only for a job released now.
        state = case((skip, "cancelled"), else_="pending")
        return {"state": state if due is None else case((due, state), else_="blocked"),
                "run_at": where_due(t.c.run_at < now, now, t.c.run_at),
                "finished_at": where_due(skip, now, t.c.finished_at),
                "cancelled_at": where_due(skip, now, t.c.cancelled_at),
                "last_error": where_due(skip, SKIPPED, t.c.last_error)}

    def blocked_dependents(self, conn: Connection, upstreams: Sequence[int]) -> list[Any]:
        """The blocked dependents of ``upstreams`` whose edge from them is still open:
        (``downstream_id``, ``upstream_id``, ``on_upstream_failure``), locked for the caller's update."""
        t, e = self.jobs, self.edges
        rows: list[Any] = []
        for chunk in _chunks(sorted(set(upstreams))):
            stmt = (select(e.c.downstream_id, e.c.upstream_id, t.c.on_upstream_failure)
                    .join(t, t.c.id == e.c.downstream_id)
                    .where(e.c.upstream_id.in_(chunk), e.c.ended.is_(None), t.c.state == "blocked")
                    .order_by(e.c.downstream_id, e.c.upstream_id))
            rows.extend(conn.execute(stmt))
        return rows

    def cancel_dependents(self, conn: Connection, reasons: dict[int, str]) -> list[int]:
        """Cancel blocked jobs, each with its reason as ``last_error``; returns those cancelled that have
        dependents of their own (their end is passed on next)."""
        t = self.jobs
        onward: list[int] = []
        now = self.now()
        for job_id, reason in sorted(reasons.items()):
            stmt = (update(t).where(t.c.id == job_id, t.c.state == "blocked")
                    .values(state="cancelled", finished_at=now, cancelled_at=now, last_error=truncate(reason)))
            if conn.execute(stmt).rowcount == 1:
                onward.append(job_id)
        if not onward:
            return []
        return list(conn.scalars(select(t.c.id).where(t.c.id.in_(onward), t.c.has_dependents)))

    def count_as_done(self, conn: Connection, edges: Sequence[tuple[int, int]], ended: str) -> None:
        """Edges (downstream, upstream) whose upstream ended ``ended`` and whose dependent runs anyway:
        marked, so a later finish of a requeued upstream does not count again, and counted down."""
        if not edges:
            return
        e, t = self.edges, self.jobs
        for downstream, upstream in edges:
            marked = conn.execute(update(e).where(e.c.downstream_id == downstream, e.c.upstream_id == upstream,
                                                  e.c.ended.is_(None)).values(ended=ended)).rowcount
            if marked:
                conn.execute(update(t).where(t.c.id == downstream, t.c.state == "blocked")
                             .values(waiting_for=t.c.waiting_for - marked))
                self._release(conn, select(e.c.downstream_id).where(e.c.downstream_id == downstream,
                                                                    e.c.upstream_id == upstream))
        self.notify(conn)

    def pass_on_failure(self, conn: Connection, upstreams: Sequence[int], ended: str) -> None:
        """Upstreams ended without finishing (``ended``: dead, cancelled, purged): each blocked dependent
        does what its ``on_upstream_failure`` says (``on_upstream_failure``), and a cancelled dependent's
        own dependents hear of it in turn, down the graph, in the caller's transaction."""
        level, how = sorted(set(upstreams)), ended
        while level:
            cancel: dict[int, str] = {}
            run: list[tuple[int, int]] = []
            for row in self.blocked_dependents(conn, level):
                action = on_upstream_failure(row.on_upstream_failure, how)
                if action == "cancel":
                    cancel.setdefault(row.downstream_id, f"upstream job {row.upstream_id} {_FAILED[how]}")
                elif action == "run":
                    run.append((row.downstream_id, row.upstream_id))
            self.count_as_done(conn, [edge for edge in run if edge[0] not in cancel], how)
            level, how = self.cancel_dependents(conn, cancel), "cancelled"

    def with_dependents(self, conn: Connection, ids: Sequence[int], states: Sequence[str]) -> list[int]:
        """Which of ``ids`` have dependents and are in one of ``states`` (after a release or a cancel)."""
        t = self.jobs
        return list(conn.scalars(select(t.c.id).where(t.c.id.in_(list(ids)), t.c.has_dependents,
                                                      t.c.state.in_(list(states)))))

    def mark_upstreams(self, conn: Connection, ids: Sequence[int]) -> None:
        """Requeued jobs that others depend on get ``has_dependents`` back (the dead table has no such column)."""
        t, e = self.jobs, self.edges
        for chunk in _chunks(sorted(set(ids))):
            conn.execute(update(t).where(t.c.id.in_(chunk), t.c.id.in_(select(e.c.upstream_id)))
                         .values(has_dependents=True))

    def forget_edges(self, conn: Connection, pruned: Sequence[int]) -> None:
        """Pruned jobs take their own dependencies with them (an upstream's edges stay while its dependent
        is kept: its ``upstreams()`` still lists it, with no state). By the primary key: cheap per batch."""
        e, b, t = self.edges, batch_table(self.jobs), self.jobs
        callbacks = [b.c.on_complete_id, b.c.on_failure_id, b.c.on_success_id]
        # Each table only where it has rows: an app without graphs or batches pays two probes, not the statements.
        edges, batches = holds_rows(conn, e), holds_rows(conn, b)
        for chunk in self.id_chunks(pruned) if edges or batches else []:
            if edges:
                conn.execute(delete(e).where(self.among_ids(e.c.downstream_id, chunk)))
            if batches:  # A batch goes with the last of its callbacks (its counts were read through their edges).
                kept = select(t.c.id).where(t.c.id.in_(callbacks)).exists()
                conn.execute(delete(b).where(or_(*(self.among_ids(c, chunk) for c in callbacks)), ~kept))

    # -- reading a graph ---------------------------------------------------------------------

    def upstreams(self, conn: Connection, job_id: int) -> list[Any]:
        """A job's upstreams in ``depends_on`` order: (``position``, ``id``, ``state``, ``result``, ``ended``);
        ``state`` and ``result`` are None for one no longer in the jobs table (dead-lettered or pruned)."""
        e, t = self.edges, self.jobs
        stmt = (select(e.c.position, e.c.upstream_id.label("id"), t.c.state, t.c.result, e.c.ended)
                .select_from(e.outerjoin(t, t.c.id == e.c.upstream_id))
                .where(e.c.downstream_id == job_id, e.c.position >= 0).order_by(e.c.position))
        return list(conn.execute(stmt))

    # -- showing a graph (the CLI, the dashboard, stats) --------------------------------------

    def blocked_by_queue(self, conn: Connection) -> list[Any]:
        """Per queue: jobs waiting for their upstreams (``queue``, ``blocked``), by queue.

        Reads only ``ix_<table>_blocked`` (state = 'blocked'; MariaDB/MySQL: the state-led ``ix_<table>_pending``).
        """
        t = self.jobs
        stmt = (select(t.c.queue, func.count().label("blocked")).where(t.c.state == "blocked")
                .group_by(t.c.queue).order_by(t.c.queue))
        return list(conn.execute(stmt))

    def neighbours(self, conn: Connection, job_id: int, *, upstream: bool, limit: int | None = None) -> list[Any]:
        """One side of a job's neighbourhood, at most ``limit`` rows: its upstreams in ``depends_on`` order
        (``upstream=True``) or its dependents by id, each (``id``, ``kind``, ``state``, ``ended``).

        ``state`` is the jobs table's, ``'dead'`` for a job in the dead letters, None for one in neither (pruned,
        or purged); ``ended`` is the edge's: how the upstream failed when a dependent ran anyway. The job may be
        in either table: a dead job's dependents are read the same way.
        """
        e, t, d = self.edges, self.jobs, self.dead
        near, far = (e.c.downstream_id, e.c.upstream_id) if upstream else (e.c.upstream_id, e.c.downstream_id)
        state = case((t.c.state.is_not(None), t.c.state), (d.c.id.is_not(None), literal("dead")))
        stmt = (select(far.label("id"), func.coalesce(t.c.kind, d.c.kind).label("kind"), state.label("state"),
                       e.c.ended)
                .select_from(e.outerjoin(t, t.c.id == far).outerjoin(d, d.c.id == far))
                .where(near == job_id)
                .order_by(e.c.position if upstream else e.c.downstream_id))
        return list(conn.execute(stmt if limit is None else stmt.limit(limit)))

    def edge_counts(self, conn: Connection, job_id: int) -> tuple[int, int]:
        """How many upstreams and how many dependents ``job_id`` has (its edges, whatever became of the jobs)."""
        e = self.edges
        ups = select(func.count()).select_from(e).where(e.c.downstream_id == job_id).scalar_subquery()
        downs = select(func.count()).select_from(e).where(e.c.upstream_id == job_id).scalar_subquery()
        row = conn.execute(select(ups.label("upstreams"), downs.label("dependents"))).one()
        return int(row.upstreams), int(row.dependents)


def _chunks(items: list[Any], size: int = 1000) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]

