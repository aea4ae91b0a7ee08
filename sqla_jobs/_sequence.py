"""Sequences: jobs with the same ``sequence_key`` run one at a time, in the order they were enqueued.

Give jobs a key, in the caller's session like any job::

    with Session(engine) as session, session.begin():
        session.add(Job(kind="apply_webhook", payload=event, sequence_key=f"customer:{customer_id}"))

Whatever the number of workers, a job of a sequence starts only once the one
enqueued before it with the same key has ended; jobs of other keys (and jobs
without a key) are not held back. "Before" is the order of the enqueuing
transactions' commits (and, within a transaction, the order the jobs were
added): enqueuers of one key take turns on the key's row in
``<jobs table>_sequences``, so two transactions can never both put a job right
after the same one.

A sequence is a chain of job-graph dependencies (``sqla_jobs._graph``), added
for you at flush: the new job depends on the key's last job if that one has not
ended, and is ``blocked`` until it has. The hand-off is the graph's: the
transaction that finishes a job releases the next one. A retrying job has not
ended, so it holds its sequence through its retries. When it is dead-lettered,
the next job does what its ``on_upstream_failure`` says:

``"hold"`` (None: the default)  it waits: requeueing the dead job resumes the sequence once that job
                                finishes; purging it lets the next one run
``"run"``                       it runs: the sequence skips the dead job (requeued later, that job runs
                                on its own, outside the order)

Cancelling a job of a sequence lets the next one run, as does a predecessor that
was pruned. A job with a ``sequence_key`` cannot have a ``unique_key`` or
``depends_on`` yet (``InvalidJob`` at flush): a waiting job would not hold its
key, and its place in the sequence is its one dependency.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Table, event
from sqlalchemy.orm import Session, UOWTransaction
from sqlalchemy.orm.attributes import instance_dict, instance_state

from ._fields import check_sequence_key, sequence_fields
from ._graph import driver_of, new_in
from .drivers import SEQUENCE_POSITION, Driver
from .errors import InvalidJob

__all__ = ["Chain", "enlist", "insert_sequenced"]

#: Jobs given a sequence_key and not flushed yet (as ``_graph._UNFLUSHED``), under a lock for the same reason.
_UNFLUSHED: weakref.WeakSet[Any] = weakref.WeakSet()
_UNFLUSHED_LOCK = threading.Lock()
_INFO_KEY = "sqla_jobs_sequences"
_ENDED = ("finished", "cancelled")


def enlist(job: Any, value: Any) -> str | None:
    """``Job.sequence_key``'s validator: the key checked, and the job remembered for its flush."""
    key = check_sequence_key(value)
    if instance_state(job).key is not None and key != instance_dict(job).get("sequence_key"):
        raise InvalidJob(f"job {job.id}: sequence_key is set before the job is first flushed")
    with _UNFLUSHED_LOCK:
        if key is None:
            _UNFLUSHED.discard(job)
        else:
            _UNFLUSHED.add(job)
    return key


@dataclass
class Chain:
    """New jobs of some sequences in one transaction, in enqueue order: (key, policy) each, which of them wait
    for the job before them, and each key's last job before these (``lock_tails``)."""

    members: list[tuple[str, str]]
    tails: dict[str, int | None] = field(default_factory=dict)
    waits: list[bool] = field(default_factory=list)

    def plan(self, conn: Connection, driver: Driver) -> None:
        """Lock the keys' rows and decide who waits: a member after another of its key in this chain, or the
        first of its key when the key's last job has not ended (or is dead, and the member holds)."""
        self.tails = driver.lock_tails(conn, [key for key, _ in self.members])
        before = sorted({last for last in self.tails.values() if last is not None})
        # Their row locks: a worker ending one now waits for this transaction, then passes its end on to the
        # new edge; or ended it first, and the state read here says so.
        states = {i: state for i, (state, _) in driver.lock_upstreams(conn, before).items()} if before else {}
        dead = driver.dead_tails(conn, [i for i in before if i not in states])
        seen: set[str] = set()
        for key, policy in self.members:
            last = self.tails.get(key)
            if key in seen:
                waits = True
            elif last is None:
                waits = False
            elif last in states:
                waits = states[last] not in _ENDED
            else:  # dead-lettered (held, unless the member skips it), or pruned / purged: ended
                waits = last in dead and policy != "run"
            seen.add(key)
            self.waits.append(waits)

    def link(self, conn: Connection, driver: Driver, ids: Sequence[int]) -> None:
        """The members have ids (in the same order): each waiting one's edge, the keys' new last jobs."""
        last: dict[str, int] = {}
        edges, marked = [], []
        for (key, _), job_id, waits in zip(self.members, ids, self.waits, strict=True):
            if waits:
                upstream = last.get(key, self.tails.get(key))
                edges.append({"downstream_id": job_id, "position": SEQUENCE_POSITION, "upstream_id": upstream})
                if key in last:
                    marked.append(upstream)
            last[key] = job_id
        driver.set_tails(conn, last)
        driver.mark_sequenced(conn, marked)
        if edges:
            driver.add_sequence_edges(conn, edges)


def insert_sequenced(conn: Connection, driver: Driver, rows: list[dict[str, Any]]) -> list[int]:
    """``enqueue_many``'s checked rows with a ``sequence_key``: inserted in order, each after the one before
    it in its sequence; their ids."""
    if not rows:
        return []
    chain = Chain([(row["sequence_key"], row["on_upstream_failure"]) for row in rows])
    chain.plan(conn, driver)
    for row, waits in zip(rows, chain.waits, strict=True):
        row["state"], row["waiting_for"] = ("blocked", 1) if waits else ("pending", 0)
    ids = driver.insert_members(conn, rows)
    chain.link(conn, driver, ids)
    return ids


@event.listens_for(Session, "before_flush")
def _before_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    """Place this flush's new sequenced jobs after their keys' last jobs, before their INSERT."""
    mine = new_in(session, _UNFLUSHED, _UNFLUSHED_LOCK)
    if not mine:
        return
    mine.sort(key=lambda job: instance_state(job).insert_order)  # the order they were added: their ids' order
    by_table: dict[Table, list[Any]] = {}
    for job in mine:
        values = instance_dict(job)
        values.update(sequence_fields(values.get("sequence_key"), values.get("on_upstream_failure"),
                                      values.get("unique_key"), job.depends_on))
        by_table.setdefault(type(job).__table__, []).append(job)
    conn = session.connection()
    plans = []
    for jobs, members in by_table.items():
        chain = Chain([(job.sequence_key, job.on_upstream_failure) for job in members])
        chain.plan(conn, driver_of(conn, jobs))
        for job, waits in zip(members, chain.waits, strict=True):
            if waits:
                # Stored directly, as the graph's flush does: the new row's INSERT reads the stored values.
                values = instance_dict(job)
                values["state"], values["waiting_for"] = "blocked", 1
        plans.append((jobs, members, chain))
    flush_context.attributes[_INFO_KEY] = plans


@event.listens_for(Session, "after_flush")
def _after_flush(session: Session, flush_context: UOWTransaction) -> None:
    """The new jobs have ids now: write their edges and their keys' last jobs, in the same transaction."""
    plans = flush_context.attributes.get(_INFO_KEY)
    if not plans:
        return
    conn = session.connection()
    for jobs, members, chain in plans:
        chain.link(conn, driver_of(conn, jobs), [job.id for job in members])
        with _UNFLUSHED_LOCK:
            for job in members:
                _UNFLUSHED.discard(job)
