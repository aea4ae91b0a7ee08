"""The statements that end a claimed run, and the reads the outcome policy makes (mixed into ``Driver``).

What an outcome *means* (retry or dead letter, refund or count, isolate or not)
is decided in one place, ``sqla_jobs/worker/outcomes.py``; these are only the
acts it asks for, each fenced by the claim token:

* ``finish``: the run succeeded (the worker's batched ``finish_and_claim`` and
  a transactional handler's commit call it too);
* ``release`` / ``release_many``: the job goes back to ``pending`` (or ends
  ``cancelled`` when a cancel was requested), with an error entry or not, the
  attempt refunded or not, marked to run alone or not;
* ``dead_letter``: the job moves to the dead-letter table;
* each of them passes the job's end on to the jobs that depend on it, in the same transaction
  (``drivers/_graph.py``: a finish counts them down, a dead letter or a cancel applies their
  ``on_upstream_failure``);
* ``expired`` / ``held_by``: runs whose runner is gone (lease out, process dead);
* ``cancel_requested``, ``finished_under``, ``errors_of``: what the policy reads
  before deciding (a cancel request, a commit whose reply was lost, refunds so far).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Select, Table, case, delete, insert, literal, select, update
from sqlalchemy.sql.elements import ColumnElement

from ._claimed import DEAD_COLUMNS, Fence
from ._operations import truncate, utcnow

__all__ = ["Endings"]


class Endings:
    """``finish``, ``release``, ``release_many``, ``dead_letter`` and the reads around them."""

    jobs: Table
    dead: Table
    discard_finished: bool

    if TYPE_CHECKING:  # Driver's own (declared here for the type checker only: Driver must win the MRO)
        def fenced(self, fences: Sequence[Fence]) -> ColumnElement[bool]: ...
        def now(self) -> ColumnElement[datetime]: ...
        def later(self, seconds: float) -> ColumnElement[datetime]: ...
        def notify(self, conn: Connection) -> None: ...
        def skip_locked(self, stmt: Select[Any]) -> Select[Any]: ...
        def unblock(self, conn: Connection, finished: Sequence[int]) -> int: ...
        def pass_on_failure(self, conn: Connection, upstreams: Sequence[int], ended: str) -> None: ...
        def with_dependents(self, conn: Connection, ids: Sequence[int], states: Sequence[str]) -> list[int]: ...

    def finish(self, conn: Connection, fences: Sequence[Fence]) -> set[int]:
        """Mark jobs finished (with ``discard_finished``: delete them); returns the ids that were still ours.

        A finished job that others depend on counts down its dependents in the same statement's
        transaction (``Graph.unblock``): the caller's transaction must be a real one, never autocommit.
        """
        if not fences:
            return set()
        t = self.jobs
        stmt = (delete(t).where(self.fenced(fences)) if self.discard_finished else update(t).where(
            self.fenced(fences)).values(state="finished", finished_at=self.now(), lease_expires_at=None))
        rows = conn.execute(stmt.returning(t.c.id, t.c.has_dependents)).all()
        upstreams = [r.id for r in rows if r.has_dependents]
        if upstreams:
            self.unblock(conn, upstreams)
        return {r.id for r in rows}

    def errors_plus(self, entry: dict[str, Any]) -> ColumnElement[Any]:
        """The ``errors`` column with ``entry`` appended, as an expression for an UPDATE."""
        raise NotImplementedError

    def release(
        self,
        conn: Connection,
        fence: Fence,
        *,
        delay: float = 0.0,
        error: str | None = None,
        attempt: int | None = None,
        refund: bool = False,
        cancel: bool = False,
        isolate: bool | None = False,
    ) -> bool:
        """Give a running job back: to ``pending`` after ``delay``, or ``cancelled``.

        The one statement behind every outcome that leaves a job in the table
        unfinished (``sqla_jobs.worker.outcomes`` decides the arguments: a retry,
        a snooze, a refunded outage, a lost or handed-back run, a cancel). A job whose
        cancellation was requested while it ran ends ``cancelled`` either way.
        ``isolate``: its next run is alone in a worker process (True: its worker
        was lost), or not (False: a run ended, so any mark is cleared); None
        leaves the mark (a shutdown interrupted the run, it did not end it).
        """
        t = self.jobs
        stopped = literal(cancel) | t.c.cancelled_at.is_not(None)
        values: dict[str, Any] = {
            "state": case((stopped, "cancelled"), else_="pending"),
            "finished_at": case((stopped, self.now()), else_=None),
            "run_at": self.later(delay) if delay else self.now(),
            "claim_token": None,
            "lease_expires_at": None,
        }
        if refund:
            values["attempts"] = t.c.attempts - 1
        if isolate is not None:
            values["isolate"] = isolate
        if error is not None:
            message = truncate(error)
            values["last_error"] = message
            values["errors"] = self.errors_plus({"attempt": attempt, "at": utcnow(), "error": message})
        stmt = update(t).where(self.fenced([fence])).values(**values)
        if conn.execute(stmt).rowcount != 1:
            return False
        # Cancelled (asked for now, or requested during the run): its dependents hear of it in this transaction.
        if self.with_dependents(conn, [fence[0]], ["cancelled"]):
            self.pass_on_failure(conn, [fence[0]], "cancelled")
        return True

    def release_many(self, conn: Connection, fences: Sequence[Fence], *, refund: bool = False,
                     isolate: bool | None = False) -> int:
        """``release`` each run, due now and without an error entry; then one NOTIFY (an UPDATE fires no
        insert trigger, so the other workers are woken here). Returns how many were still ours."""
        released = sum(self.release(conn, fence, refund=refund, isolate=isolate) for fence in fences)
        if released:
            self.notify(conn)
        return released

    def dead_letter(self, conn: Connection, fence: Fence, error: str) -> bool:
        """Move a job that used its last attempt to the dead-letter table, in the caller's transaction."""
        t = self.jobs
        row = conn.execute(delete(t).where(self.fenced([fence])).returning(*t.c)).first()
        if row is None:
            return False
        message = truncate(error)
        errors = [*(row.errors or []), {"attempt": row.attempts, "at": utcnow(), "error": message}]
        # A dead row with this id can only exist if ids were reused (a SQLite table rebuilt without
        # AUTOINCREMENT). Failing here would retry forever; replace it, and keep a note of it.
        d = self.dead
        older = conn.execute(delete(d).where(d.c.id == row.id).returning(d.c.kind, d.c.last_error)).first()
        if older is not None:
            note = f"replaced an older dead job with the same id (kind {older.kind!r}): {older.last_error}"
            errors.insert(0, {"attempt": None, "at": utcnow(), "error": truncate(note)})
        conn.execute(
            insert(d).values(
                **{c: getattr(row, c) for c in DEAD_COLUMNS}, last_error=message, errors=errors, failed_at=self.now()
            )
        )
        if row.has_dependents:
            self.pass_on_failure(conn, [row.id], "dead")
        return True

    def expired(self, conn: Connection, limit: int = 100, settle: float = 0.0) -> list[Any]:
        """Running jobs whose lease ran out (their worker died or lost the database).

        Nothing while the database server has been up for less than ``settle`` seconds (the reaper gives
        its lease): when the server comes back from an outage longer than the lease, every lease has run
        out while its worker, alive and mid-handler, could not renew it. Reaped then, each job would run
        a second time beside its first run, with an attempt charged. A live worker renews within half a
        second of the server's return (``worker/reconnect.py``); a worker that really died is reaped
        once the server has been up that long.
        """
        if settle > 0:
            uptime = self.server_uptime(conn)
            if uptime is not None and uptime < settle:
                return []
        t = self.jobs
        stmt = (
            select(t.c.id, t.c.kind, t.c.queue, t.c.attempts, t.c.max_attempts, t.c.claim_token, t.c.locked_by,
                   t.c.cancelled_at)
            .where(t.c.state == "running", t.c.lease_expires_at < self.now())
            .order_by(t.c.lease_expires_at)
            .limit(limit)
        )
        return list(conn.execute(self.skip_locked(stmt)))

    def held_by(self, conn: Connection, worker: str) -> list[Any]:
        """Running jobs claimed by ``worker`` (its process is known dead), same columns as ``expired``.

        Reads ``ix_<table>_running``. A row locked at this instant (the dead
        process's last statement still being undone) is skipped: its lease covers it.
        """
        t = self.jobs
        stmt = (
            select(t.c.id, t.c.kind, t.c.queue, t.c.attempts, t.c.max_attempts, t.c.claim_token, t.c.locked_by,
                   t.c.cancelled_at)
            .where(t.c.state == "running", t.c.locked_by == worker)
            .order_by(t.c.id)
        )
        return list(conn.execute(self.skip_locked(stmt)))

    def cancel_requested(self, conn: Connection, fence: Fence) -> bool:
        """Whether someone asked to cancel this (still ours) run while it ran."""
        t = self.jobs
        return bool(conn.execute(select(t.c.cancelled_at.is_not(None)).where(self.fenced([fence]))).scalar())

    def finished_under(self, conn: Connection, fence: Fence) -> bool:
        """Whether the job was finished under this claim (the finish keeps the claim token)."""
        t = self.jobs
        stmt = select(t.c.id).where(t.c.id == fence[0], t.c.claim_token == fence[1], t.c.state == "finished")
        return conn.execute(stmt).first() is not None

    def errors_of(self, conn: Connection, fence: Fence) -> list[dict[str, Any]]:
        """The error history of this (still ours) run's job; empty if none or no longer ours."""
        t = self.jobs
        return list(conn.execute(select(t.c.errors).where(self.fenced([fence]))).scalar() or [])
