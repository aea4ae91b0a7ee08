"""Batches: a group of jobs with callback jobs that run once, when the last member has ended.

Make a ``Batch`` with its callbacks (new jobs, not added yet) and give it members,
in the caller's session like any job::

    from sqla_jobs import Batch

    with Session(engine) as session, session.begin():
        batch = Batch(on_complete=Job(kind="import_report", payload={"import": 7}),
                      on_failure=Job(kind="alert_ops", payload={"import": 7}),
                      label="import 7")
        session.add_all(Job(kind="import_row", payload={"row": i}, batch=batch) for i in range(1000))

    # or, 100,000 members through COPY on PostgreSQL:
    queue.enqueue_many(session, ({"kind": "import_row", "payload": {"row": i}} for i in range(100_000)),
                       batch=batch)

The callbacks come along with the first member's flush; ``batch.id`` is set then.

``on_complete``  runs once every member has ended: finished, dead-lettered or cancelled
``on_success``   runs once every member has finished; a dead-lettered member holds it until
                 requeued (then it may still finish) or purged (then it is cancelled, as it is
                 when a member is cancelled)
``on_failure``   runs once every member has ended, if one was dead-lettered or cancelled;
                 when every member finished it is cancelled, with the reason ``skipped: ...``

Each callback is released in the transaction that ends the last member (the
hand-off of job graphs, ``sqla_jobs._graph``), so it is enqueued exactly once
and no crash can lose it. A callback's handler reads how the batch went with
``current_job().batch()``: a ``BatchStatus`` with the counts of members
``finished``, ``dead``, ``cancelled``, and those still ``waiting``.

More members can join a batch later, in any transaction, by object or by id
(``Job(..., batch=batch.id)``), as long as no callback has been released: for
example from a member's own handler, which keeps the batch open while it runs.
A batch whose callbacks have left ``blocked`` raises ``InvalidJob``.

A batch needs at least one callback (its counts are read through a callback's
dependencies); a callback cannot have ``depends_on`` or a ``unique_key`` of its
own, and no job can depend on an ``on_failure`` callback (it may be skipped).
The batch row lives in ``<jobs table>_batches``, which ``JobMixin`` adds to
your metadata; it is deleted when its last callback is pruned.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, event
from sqlalchemy.orm import Session, UOWTransaction
from sqlalchemy.orm.attributes import instance_dict, instance_state

from ._graph import driver_of, is_job, new_in
from .drivers import CALLBACK_POLICIES, Driver
from .errors import InvalidJob

__all__ = ["Batch", "BatchOf", "BatchStatus", "add_members", "status_of"]

_ATTRIBUTE = "_sqla_jobs_batch"
_INFO_KEY = "sqla_jobs_batches"
#: Jobs given a batch and not flushed yet (as ``_graph._UNFLUSHED``), under a lock for the same reason.
_UNFLUSHED: weakref.WeakSet[Any] = weakref.WeakSet()
_UNFLUSHED_LOCK = threading.Lock()


class Batch:
    """A group of jobs and the callback jobs that run when the last of them has ended (module docstring).

    ``on_complete``, ``on_success``, ``on_failure``: new jobs (at least one); ``label``: a name for people,
    shown by ``sqla-jobs batches`` and the dashboard. ``id`` is None until the first member is flushed.
    """

    def __init__(self, *, on_complete: Any = None, on_success: Any = None, on_failure: Any = None,
                 label: str | None = None) -> None:
        given = {"on_complete": on_complete, "on_success": on_success, "on_failure": on_failure}
        self.callbacks = {name: job for name, job in given.items() if job is not None}
        if not self.callbacks:
            raise InvalidJob("a Batch needs a callback: on_complete, on_success or on_failure (a Job to run "
                             "when the members have ended)")
        if label is not None and (not isinstance(label, str) or len(label) > 255):
            raise InvalidJob(f"Batch label must be text of at most 255 characters, got {label!r}")
        seen: set[int] = set()
        for name, job in self.callbacks.items():
            if not is_job(job):
                raise InvalidJob(f"Batch {name} must be a new job (an object of a JobMixin model), got {job!r}")
            if instance_state(job).key is not None or instance_state(job).session_id is not None:
                raise InvalidJob(f"Batch {name} must be a new job, not one already added to a session "
                                 "(the batch adds it with its first member)")
            if id(job) in seen:
                raise InvalidJob("a Batch's callbacks must be three different jobs")
            if job.depends_on or job.unique_key is not None or job.on_upstream_failure is not None:
                raise InvalidJob(f"Batch {name}: a callback waits for the batch's members only; give it no "
                                 "depends_on, unique_key or on_upstream_failure")
            seen.add(id(job))
            # Set now, not at flush: a flush that adds a dependent of a callback checks it (sqla_jobs._graph).
            instance_dict(job)["on_upstream_failure"] = CALLBACK_POLICIES[name]
        self.label = label
        self.id: int | None = None

    @property
    def on_complete(self) -> Any:
        return self.callbacks.get("on_complete")

    @property
    def on_success(self) -> Any:
        return self.callbacks.get("on_success")

    @property
    def on_failure(self) -> Any:
        return self.callbacks.get("on_failure")

    def __repr__(self) -> str:
        names = ", ".join(self.callbacks)
        return f"Batch(id={self.id}, label={self.label!r}, callbacks: {names})"


@dataclass(frozen=True)
class BatchStatus:
    """How a batch stands: its members' counts and its callbacks' states (None once pruned).

    ``waiting`` counts members not ended yet (pending, scheduled, blocked or running); ``dead`` those in
    the dead letters now; ``removed`` those in neither table (pruned or purged).
    """

    id: int
    label: str | None
    created_at: datetime
    total: int
    waiting: int
    finished: int
    dead: int
    cancelled: int
    removed: int
    callbacks: dict[str, tuple[int, str | None]]

    @property
    def complete(self) -> bool:
        """Every member has ended (a callback that waits for a dead member may still be blocked)."""
        return self.waiting == 0

    @property
    def failed(self) -> int:
        return self.dead + self.cancelled


def status_of(driver: Driver, conn: Connection, row: Any) -> BatchStatus | None:
    """A batch row read into a ``BatchStatus`` (None for None)."""
    if row is None:
        return None
    counts = driver.member_counts(conn, row)
    return BatchStatus(id=int(row.id), label=row.label, created_at=row.created_at, total=int(row.total),
                       callbacks=driver.callback_states(conn, row), **counts)


class BatchOf:
    """The ``batch`` attribute of a job model: the ``Batch`` (or a batch's id) it is a member of, set before
    its first flush; reads back as given (None: none)."""

    def __get__(self, job: Any, owner: type | None = None) -> Any:
        if job is None:
            return self
        return job.__dict__.get(_ATTRIBUTE)

    def __set__(self, job: Any, value: Any) -> None:
        if instance_state(job).key is not None:
            raise InvalidJob(f"job {job.id}: batch is set before the job is first flushed")
        if value is not None and not isinstance(value, Batch) and (isinstance(value, bool)
                                                                   or not isinstance(value, int)):
            raise InvalidJob(f"Job.batch must be a Batch or a batch's id, got {value!r}")
        if value is not None and any(job is callback for callback in getattr(value, "callbacks", {}).values()):
            raise InvalidJob("a batch's callback cannot be one of its members")
        job.__dict__[_ATTRIBUTE] = value
        with _UNFLUSHED_LOCK:
            if value is None:
                _UNFLUSHED.discard(job)
            else:
                _UNFLUSHED.add(job)


@dataclass
class _Joining:
    """Members of one batch in one flush, and where their edges go once they have ids."""

    batch: Batch | int
    members: list[Any]
    first: int
    callbacks: list[Any]  # ids, or the new callback objects (their ids after the flush)


@event.listens_for(Session, "before_flush")
def _before_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    """Open (or grow) the batches of this flush's new members, before their INSERT."""
    mine = new_in(session, _UNFLUSHED, _UNFLUSHED_LOCK)
    if not mine:
        return
    groups: dict[Any, list[Any]] = {}
    for job in mine:
        groups.setdefault(_key(job.batch), []).append(job)
    conn = session.connection()
    joining = []
    for members in groups.values():
        batch, jobs = members[0].batch, type(members[0]).__table__
        if any(type(m).__table__ is not jobs for m in members):
            raise InvalidJob("a batch's members and callbacks are jobs of one jobs table")
        joining.append(_open(session, conn, driver_of(conn, jobs), jobs, batch, len(members), members))
        for member in members:
            instance_dict(member)["has_dependents"] = True
    flush_context.attributes[_INFO_KEY] = joining


def _key(batch: Batch | int) -> Any:
    return ("id", batch) if isinstance(batch, int) else ("id", batch.id) if batch.id is not None else id(batch)


def _open(session: Session, conn: Connection, driver: Driver, jobs: Table, batch: Batch | int, added: int,
          members: list[Any]) -> _Joining:
    """Make the batch (and add its callbacks to ``session``, waiting for ``added`` members) or grow it."""
    if isinstance(batch, Batch) and batch.id is None:
        for name, callback in batch.callbacks.items():
            if type(callback).__table__ is not jobs:
                raise InvalidJob(f"Batch {name} is a job of table {type(callback).__table__.name!r}, its members "
                                 f"of {jobs.name!r}: a batch stays within one jobs table")
            values = instance_dict(callback)
            values["state"], values["waiting_for"] = "blocked", added
            session.add(callback)
        batch.id = driver.insert_batch(conn, batch.label)
        driver.grow_batch(conn, batch.id, added)
        return _Joining(batch, members, 0, list(batch.callbacks.values()))
    return _Joining(batch, members, *_grow(conn, driver, batch if isinstance(batch, int) else batch.id, added))


def _grow(conn: Connection, driver: Driver, batch_id: int | None, added: int) -> tuple[int, list[Any]]:
    assert batch_id is not None
    grown = driver.grow_batch(conn, batch_id, added)
    if grown is None:
        raise InvalidJob(f"batch {batch_id} does not exist (never made, or pruned with its callbacks)")
    first, states = grown
    ended = {i: s for i, s in states.items() if s != "blocked"}
    if ended:
        shown = ", ".join(f"job {i} is {s}" for i, s in sorted(ended.items()))
        raise InvalidJob(f"batch {batch_id} has ended ({shown}): members join a batch before its last member "
                         "ends (for example from a member's handler); start a new batch")
    driver.wait_for_more(conn, list(states), added)
    return first, list(states)


@event.listens_for(Session, "after_flush")
def _after_flush(session: Session, flush_context: UOWTransaction) -> None:
    """The members and callbacks have ids now: name the callbacks, write the edges."""
    joining = flush_context.attributes.get(_INFO_KEY)
    if not joining:
        return
    conn = session.connection()
    for plan in joining:
        driver = driver_of(conn, type(plan.members[0]).__table__)
        _link(conn, driver, plan.batch, [m.id for m in plan.members], plan.first, plan.callbacks)
        with _UNFLUSHED_LOCK:
            for member in plan.members:
                _UNFLUSHED.discard(member)


def _link(conn: Connection, driver: Driver, batch: Batch | int, member_ids: Sequence[int], first: int,
          callbacks: Sequence[Any]) -> None:
    ids = [c if isinstance(c, int) else c.id for c in callbacks]
    if isinstance(batch, Batch) and batch.id is not None and any(not isinstance(c, int) for c in callbacks):
        driver.set_callbacks(conn, batch.id, {name: job.id for name, job in batch.callbacks.items()})
    driver.add_edges(conn, [(callback, first + i, member) for callback in ids for i, member in enumerate(member_ids)])


def add_members(session: Session, driver: Driver, jobs: Table, batch: Batch | int,
                rows: Iterable[Mapping[str, Any]]) -> int:
    """``enqueue_many(..., batch=)``: insert checked rows as members of ``batch`` (COPY on PostgreSQL) and
    link them; returns how many. Rows with a ``unique_key`` whose key is held are skipped, as there."""
    conn = session.connection()
    items = list(rows)
    if any("sequence_key" in r for r in items):
        raise InvalidJob("enqueue_many(..., batch=) takes no sequence_key yet: add sequenced members with "
                         "session.add(Job(..., batch=batch, sequence_key=...))")
    if any(r.get("on_duplicate", "keep") != "keep" for r in items):
        raise InvalidJob("a batch's members are new jobs: on_duplicate 'replace' or 'debounce' would change a job "
                         "that is not in the batch; leave it out (a held key skips the item)")
    plain = [dict(r) for r in items if r["unique_key"] is None]
    ids = driver.insert_members(conn, plain) if plain else []
    for row in items:
        if row["unique_key"] is not None:
            new_id = driver.insert_unique(conn, dict(row))
            if new_id is not None:
                ids.append(new_id)
    if not ids:
        return 0
    if len(ids) > len(plain):
        driver.lock_upstreams(conn, ids[len(plain):])  # marks the keyed ones as having dependents
    if isinstance(batch, Batch) and batch.id is None:
        plan = _open(session, conn, driver, jobs, batch, len(ids), [])
        session.flush()  # the callbacks, blocked for these members
    else:
        plan = _Joining(batch, [], *_grow(conn, driver, batch if isinstance(batch, int) else batch.id, len(ids)))
    _link(conn, driver, batch, ids, plan.first, plan.callbacks)
    return len(ids)
