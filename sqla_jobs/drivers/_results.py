"""Results, progress, cancel requests and trace contexts of running jobs: portable Core for every backend
(mixed into ``Driver``).

None of these is on the worker's hot path: a handler that returns None and
sets no progress is finished by the batched ``finish_and_claim`` exactly as
before. A returned value (or a last progress value) is written by
``set_results`` just before that job's ``finish``, in the same transaction,
both fenced by the claim token, so a result is never stored for a run whose
claim was lost. Every statement names rows by primary key and has no
``RETURNING``, so MariaDB/MySQL need no override. ``trace_contexts`` is read only
when tracing is on (``sqla_jobs.otel``): the claim itself does not carry the column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Table, and_, bindparam, select, update
from sqlalchemy.sql.elements import ColumnElement

__all__ = ["Flow", "ResultRow"]

Fence = tuple[int, str]
#: (fence, result, progress): a value to store, or None to leave that column as it is.
ResultRow = tuple[Fence, Any, Any]


class Flow:
    """``set_results``, ``set_progress``, ``cancel_requests``, ``result_of``, ``trace_contexts``."""

    jobs: Table
    discard_finished: bool

    def fenced(self, fences: Sequence[Fence]) -> ColumnElement[bool]:
        raise NotImplementedError

    def _fenced_one(self) -> ColumnElement[bool]:
        """One running row under its claim, with the fence bound per row (for executemany)."""
        t = self.jobs
        return and_(t.c.id == bindparam("f_id"), t.c.claim_token == bindparam("f_token"), t.c.state == "running")

    def set_results(self, conn: Connection, rows: Sequence[ResultRow]) -> None:
        """Store each run's result and/or last progress while it is still ours (then ``finish`` it).

        Nothing to store where ``finish`` deletes the jobs (``discard_finished``): the row goes next.
        """
        if self.discard_finished:
            return
        t = self.jobs
        # One executemany per set of columns written: a None leaves its column as it is.
        groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for (job_id, token), result, progress in rows:
            values = {c: v for c, v in (("result", result), ("progress", progress)) if v is not None}
            if values:
                groups.setdefault(tuple(values), []).append(
                    {"f_id": job_id, "f_token": token, **{f"v_{c}": v for c, v in values.items()}}
                )
        for columns, batch in groups.items():
            stmt = update(t).where(self._fenced_one()).values(
                {c: bindparam(f"v_{c}", type_=t.c[c].type) for c in columns}
            )
            conn.execute(stmt, batch)

    def set_progress(self, conn: Connection, rows: Sequence[tuple[Fence, Any]]) -> None:
        """Store the progress values of runs still ours; a run no longer ours is left alone."""
        if rows:
            self.set_results(conn, [(fence, None, progress) for fence, progress in rows])

    def cancel_requests(self, conn: Connection, fences: Sequence[Fence]) -> set[Fence]:
        """Which of these runs (still ours) someone asked to cancel (``cancelled_at`` set)."""
        if not fences:
            return set()
        t = self.jobs
        stmt = select(t.c.id, t.c.claim_token).where(self.fenced(fences), t.c.cancelled_at.is_not(None))
        return {(r.id, r.claim_token) for r in conn.execute(stmt)}

    def result_of(self, conn: Connection, job_id: int) -> tuple[str, Any] | None:
        """(state, result) of a job, or None if there is no such job."""
        t = self.jobs
        row = conn.execute(select(t.c.state, t.c.result).where(t.c.id == job_id)).first()
        return None if row is None else (str(row.state), row.result)

    def trace_contexts(self, conn: Connection, ids: Sequence[int]) -> dict[int, dict[str, str]]:
        """The stored trace context (``traceparent``, ``tracestate``) of each of these jobs that has one."""
        if not ids:
            return {}
        t = self.jobs
        stmt = select(t.c.id, t.c.trace_context).where(t.c.id.in_(list(ids)), t.c.trace_context.is_not(None))
        return {int(r.id): r.trace_context for r in conn.execute(stmt)}
