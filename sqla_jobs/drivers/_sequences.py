"""Sequences' statements: the table of each sequence's last job, and a new job's place after it (mixed into ``Driver``).

A sequence is a chain of job-graph edges (``drivers/_graph.py``): each new job with
a ``sequence_key`` depends on the job enqueued before it with that key, if that
one has not ended. The edge has ``position`` -1 (``SEQUENCE_POSITION``), so it
never collides with a ``depends_on`` position and ``upstream_results()`` leaves it
out. Finding "the job before it" is the one thing graphs do not do, and it must
hold under concurrent enqueuers: ``<jobs>_sequences`` has one row per key, holding
the id of the last job enqueued with it (``last_id``). An enqueue locks its key's
row first (``take_tails``: made if missing, then read with a locking read), so two
transactions enqueueing to one key take turns, and the second sees the first's job
as the tail once the first commits. A rolled-back enqueue leaves no trace; a
committed one is the tail until the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Column,
    Connection,
    MetaData,
    Select,
    String,
    Table,
    and_,
    case,
    delete,
    exists,
    insert,
    literal,
    or_,
    select,
    tuple_,
    update,
)

from ._setup import beside

__all__ = ["SEQUENCE_POSITION", "SEQUENCE_SUFFIX", "Sequences", "sequence_table"]

#: The table is ``<jobs table>_sequences``, in the jobs table's schema.
SEQUENCE_SUFFIX = "_sequences"
#: The ``position`` of a sequence's edge in ``<jobs>_deps`` (``depends_on`` positions count from 0).
SEQUENCE_POSITION = -1
#: The longest ``sequence_key`` (an indexed column: the limit every backend's index takes).
MAX_SEQUENCE_KEY_LENGTH = 255


def sequence_table(jobs: Table, metadata: MetaData | None = None) -> Table:
    """``<jobs>_sequences`` beside ``jobs``: made in ``jobs``' metadata the first time, the same Table after.

    ``last_id`` is NULL only between the row's insert and its update, in one transaction. No foreign key
    (``edge_table`` says why); the row outlives the job it names (pruned, purged): that job has then ended.
    """
    metadata, name, found = beside(jobs, SEQUENCE_SUFFIX, metadata)
    if found is not None:
        return found
    return Table(
        name,
        metadata,
        Column("key", String(MAX_SEQUENCE_KEY_LENGTH), primary_key=True, autoincrement=False),
        Column("last_id", jobs.c.id.type, nullable=True),
        schema=jobs.schema,
    )


class Sequences:
    """The statements of sequences (see the module docstring)."""

    jobs: Table
    dead: Table

    if TYPE_CHECKING:  # Driver's own (declared here for the type checker only: Driver must win the MRO)
        edges: Table

        def upsert(self, conn: Connection, table: Table, row: dict[str, Any] | list[dict[str, Any]],
                   update: Sequence[str] = ()) -> None: ...

        def lock_upstreams(self, conn: Connection, ids: Sequence[int]) -> dict[int, tuple[str, str | None]]: ...

        def skip_locked(self, stmt: Select[Any]) -> Select[Any]: ...

    @property
    def sequences(self) -> Table:
        return sequence_table(self.jobs)

    def lock_tails(self, conn: Connection, keys: Iterable[str]) -> dict[str, int | None]:
        """Lock each key's row (made if missing), in key order so that two enqueuers of the same keys cannot
        deadlock; returns each key's ``last_id``.

        The row is made with the backend's insert-or-nothing (which waits for an uncommitted insert of the
        same key), then read with a locking read: that read waits for any other enqueuer of the key to
        commit or roll back, and sees its row as it then is (MariaDB's REPEATABLE READ included).
        """
        s = self.sequences
        tails: dict[str, int | None] = {}
        missing = sorted(set(keys))
        while missing:
            for key in missing:
                self.upsert(conn, s, {"key": key, "last_id": None})
            for chunk in [missing[i:i + 500] for i in range(0, len(missing), 500)]:
                rows = conn.execute(select(s.c.key, s.c.last_id).where(s.c.key.in_(chunk)).order_by(s.c.key)
                                    .with_for_update())
                tails.update({r.key: r.last_id for r in rows})
            # PostgreSQL's insert-or-nothing takes no lock: a pruner (``prune_sequences``) may have deleted the
            # row between it and the locking read, which then finds none. Made again, it is ours.
            missing = [key for key in missing if key not in tails]
        return tails

    def prune_sequences(self, conn: Connection, limit: int) -> int:
        """Delete up to ``limit`` keys' rows whose last job has ended (finished, cancelled or pruned; not dead: a
        holding sequence waits for its dead job's requeue): a new job of the key then waits for nothing, as it
        would with the row. A row is deleted under its lock and only with the last job it was found with, so
        an enqueuer that took the key meanwhile keeps it (``lock_tails`` makes a row deleted under it again)."""
        s, t, d = self.sequences, self.jobs, self.dead
        running = exists().where(t.c.id == s.c.last_id, t.c.state.not_in(("finished", "cancelled")))
        dead = exists().where(d.c.id == s.c.last_id)
        stale = conn.execute(select(s.c.key, s.c.last_id).where(~running, ~dead).order_by(s.c.key)
                             .limit(limit)).all()  # a plain read: MariaDB's locking read would lock the jobs too
        if not stale:
            return 0
        locked = conn.execute(self.skip_locked(select(s.c.key, s.c.last_id).where(
            s.c.key.in_([r.key for r in stale])).order_by(s.c.key))).all()
        found = {(r.key, r.last_id) for r in stale}
        still = [r for r in locked if (r.key, r.last_id) in found]
        if not still:
            return 0
        pairs = [(r.key, r.last_id) for r in still if r.last_id is not None]
        unset = [r.key for r in still if r.last_id is None]
        which = [tuple_(s.c.key, s.c.last_id).in_(pairs)] if pairs else []
        which += [and_(s.c.key.in_(unset), s.c.last_id.is_(None))] if unset else []
        return conn.execute(delete(s).where(or_(*which))).rowcount

    def set_tails(self, conn: Connection, tails: Mapping[str, int]) -> None:
        """Each key's last job is now ``tails[key]`` (rows this transaction locked with ``lock_tails``)."""
        s = self.sequences
        for key, last in sorted(tails.items()):
            conn.execute(update(s).where(s.c.key == key).values(last_id=last))

    def add_sequence_edges(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """The new jobs' edges to the jobs before them, by INSERT: a flush adds a few (one per job), where
        ``Graph.add_edges``' COPY on PostgreSQL, made for a fan-in's thousands, cost a round trip more."""
        for i in range(0, len(rows), 5000):
            conn.execute(insert(self.edges), list(rows[i:i + 5000]))

    def dead_tails(self, conn: Connection, ids: Sequence[int]) -> set[int]:
        """Which of ``ids`` are in the dead letters, read with a locking read (the latest rows, and a purge or
        requeue of one waits for this transaction: it then sees the new job's edge)."""
        d = self.dead
        if not ids:
            return set()
        return set(conn.scalars(select(d.c.id).where(d.c.id.in_(sorted(set(ids)))).with_for_update()))

    def mark_sequenced(self, conn: Connection, ids: Sequence[int]) -> None:
        """New jobs whose successor in their sequence was enqueued in the same transaction: their end is passed
        on (``has_dependents``; existing predecessors get it from ``Graph.lock_upstreams``)."""
        t = self.jobs
        if ids:
            conn.execute(update(t).where(t.c.id.in_(sorted(set(ids)))).values(has_dependents=True))

    def predecessor(self, conn: Connection, job_id: int) -> Any:
        """The job a sequenced job waits for (or waited for): (``id``, ``state``, ``ended``), ``state`` as
        ``Graph.neighbours`` gives it (``'dead'``, or None once pruned or purged); None when it had none."""
        e = self.edges
        t, d = self.jobs, self.dead
        state = case((t.c.state.is_not(None), t.c.state), (d.c.id.is_not(None), literal("dead")))
        stmt = (select(e.c.upstream_id.label("id"), state.label("state"), e.c.ended)
                .select_from(e.outerjoin(t, t.c.id == e.c.upstream_id).outerjoin(d, d.c.id == e.c.upstream_id))
                .where(e.c.downstream_id == job_id, e.c.position == SEQUENCE_POSITION))
        return conn.execute(stmt).first()

    def cancel(self, conn: Connection, job_id: int) -> tuple[bool, str | None]:
        """``Operations.cancel``, after splicing the sequence: a job cancelled while it waits its turn would
        release the job after it at once (a cancelled upstream counts as done), while the job before it may
        still be running. So the one after it waits for the one before it instead (its edge re-pointed, and the
        key's last job too if it was this one), under the locks an enqueue takes, in its order: the key's row,
        then the job before. One indexed read for a job outside a sequence."""
        e, t, s = self.edges, self.jobs, self.sequences
        row = conn.execute(select(t.c.sequence_key, e.c.upstream_id)
                           .join(e, and_(e.c.downstream_id == t.c.id, e.c.position == SEQUENCE_POSITION,
                                         e.c.ended.is_(None)))
                           .where(t.c.id == job_id, t.c.state == "blocked")).first()
        if row is not None:
            before = row.upstream_id
            self.lock_tails(conn, [row.sequence_key])
            states = self.lock_upstreams(conn, [before])
            dead = before not in states and before in self.dead_tails(conn, [before])
            if dead or states.get(before, ("finished",))[0] not in ("finished", "cancelled"):
                after = select(e.c.downstream_id).where(e.c.upstream_id == job_id,
                                                        e.c.position == SEQUENCE_POSITION, e.c.ended.is_(None))
                # A successor that skips dead jobs does not wait for a dead one ('run': counted as done).
                holding = select(t.c.id).where(t.c.id.in_(after), t.c.on_upstream_failure != "run") if dead else after
                ids = list(conn.scalars(holding))
                if ids:
                    conn.execute(update(e).where(e.c.downstream_id.in_(ids), e.c.position == SEQUENCE_POSITION)
                                 .values(upstream_id=before))
                conn.execute(update(s).where(s.c.key == row.sequence_key, s.c.last_id == job_id)
                             .values(last_id=before))
        return super().cancel(conn, job_id)  # type: ignore[misc,no-any-return]
