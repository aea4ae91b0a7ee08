"""Job graphs: a job that waits for others, added in the caller's session like any job.

Give a job the jobs it waits for, as objects (before or after they are flushed)
or as ids of jobs already in the table::

    with Session(engine) as session, session.begin():
        pages = [Job(kind="render_page", payload={"page": i}) for i in range(40)]
        merge = Job(kind="merge_pdf", payload={}, depends_on=pages)
        mail = Job(kind="send_pdf", payload={}, depends_on=[merge])
        session.add_all([*pages, merge, mail])

``merge`` is ``blocked`` until every page has finished; the transaction that
finishes the last page makes it ``pending`` (and wakes a listening worker), so
no sweeper polls for it and no crash can lose the hand-off: the count goes
down with the finish or not at all. Its handler reads what the pages
returned, in ``depends_on`` order, with ``current_job().upstream_results()``.

When an upstream is dead-lettered or cancelled, a blocked dependent does what
its ``on_upstream_failure`` says:

``"cancel"`` (the default)  it is cancelled, with the upstream named in ``last_error``,
                            and so are its own dependents, down the graph
``"run"``                   the upstream counts as done; its result reads as None
``"wait"``                  it stays blocked: requeueing the dead upstream resumes the graph
                            (a cancelled upstream, or a dead one purged, cancels it)
``"hold"``                  as ``wait`` while the upstream is dead, but a cancelled or purged
                            upstream counts as done (a sequence's default: ``sqla_jobs._sequence``)

Checked at flush, in the caller's transaction, so a bad graph fails before
anything is written: a job that depends on itself or on a cycle of new jobs,
on a job of another jobs table, on a job in the dead letters, on an id that
is not in the table, or on a cancelled job (unless it runs anyway) raises
``InvalidJob`` naming the problem. The jobs a new job depends on are locked
for the rest of the transaction (a worker finishing one waits for the commit),
which is what makes adding a dependent race-free. ``depends_on`` is set once,
before the job's first flush.

The dependencies live in a third table beside the jobs table,
``<jobs table>_deps``, which ``JobMixin`` adds to your metadata.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Table, event
from sqlalchemy.orm import Session, UOWTransaction
from sqlalchemy.orm.attributes import instance_dict, instance_state

from .drivers import ERRBACK, FAILURE_POLICIES, Driver, driver_for, edge_table
from .errors import InvalidJob

__all__ = ["DependsOn", "check_policy", "driver_of", "is_job", "new_in", "register_tables"]

#: Each jobs table's dead-letter table, as the ``JobQueue`` that pairs them said (for the flush's checks).
_DEAD: weakref.WeakKeyDictionary[Table, Table] = weakref.WeakKeyDictionary()
#: Jobs given ``depends_on`` and not flushed yet: a flush looks only at these, not at every new object.
_UNFLUSHED: weakref.WeakSet[Any] = weakref.WeakSet()
#: Sessions in other threads add and flush at the same time: a WeakSet must not change while it is copied.
_UNFLUSHED_LOCK = threading.Lock()
_DRIVERS: dict[tuple[type, Table], Driver] = {}
_ATTRIBUTE = "_sqla_jobs_depends_on"
_DISTINCT = "_sqla_jobs_upstreams"  # each upstream once, as the flush counted them (its edges, after)
#: When each job's depends_on was set, in order: a cycle needs a job whose upstream's was set after its own.
_SET_AT = "_sqla_jobs_set_at"
_SETS = itertools.count()
_INFO_KEY = "sqla_jobs_graph"
_PAGE_KEY = "sqla_jobs_graph_page"
#: Rows per INSERT statement while a flush writes new dependents (SQLAlchemy's own default is 1,000). Each
#: dependent carries three more values than a plain job (its state, its count, whether others wait for it);
#: at 1,000 rows a statement, the driver's parsing of 5,000 placeholders and the garbage collector's rounds
#: over that parse's temporaries made a 10,000-job chain's enqueue 1.47x a plain one's, at 100 rows 1.29x
#: (medians of eight ``sqla-jobs bench --graphs enqueue`` each way, docs/performance.md). Plain jobs' flushes keep the
#: engine's setting.
DEPENDENTS_PAGE = 100


def register_tables(jobs: Table, dead: Table) -> None:
    """Called by ``JobQueue``: ``jobs``' dead letters are in ``dead``; ``jobs`` gets its edge table."""
    _DEAD[jobs] = dead
    edge_table(jobs)


def check_policy(value: Any) -> str | None:
    if value is not None and value not in FAILURE_POLICIES:
        raise InvalidJob(f"Job.on_upstream_failure must be one of {', '.join(map(repr, FAILURE_POLICIES))} "
                         f"(or None: 'cancel'), got {value!r}")
    return value  # type: ignore[no-any-return]


class DependsOn:
    """The ``depends_on`` attribute of a job model: the jobs it waits for (objects or ids), set before its
    first flush; reads back as the tuple given (empty: none)."""

    def __get__(self, job: Any, owner: type | None = None) -> Any:
        if job is None:
            return self
        return job.__dict__.get(_ATTRIBUTE, ())

    def __set__(self, job: Any, value: Any) -> None:
        if instance_state(job).key is not None:
            raise InvalidJob(f"job {job.id}: depends_on is set before the job is first flushed")
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise InvalidJob(f"Job.depends_on must be a list of jobs or job ids, got {value!r}")
        upstreams = tuple(value)
        for upstream in upstreams:
            if isinstance(upstream, bool) or not (isinstance(upstream, int) or is_job(upstream)):
                raise InvalidJob(f"Job.depends_on holds jobs (objects of a JobMixin model) or their ids, "
                                 f"got {upstream!r}")
            if upstream is job:
                raise InvalidJob("a job cannot depend on itself")
        job.__dict__[_ATTRIBUTE] = upstreams
        job.__dict__[_SET_AT] = next(_SETS)
        with _UNFLUSHED_LOCK:
            if upstreams:
                _UNFLUSHED.add(job)
            else:
                _UNFLUSHED.discard(job)


def is_job(value: Any) -> bool:
    """An object of a job model (JobMixin's models import this module: known by their ``depends_on``)."""
    return isinstance(getattr(type(value), "depends_on", None), DependsOn)


def new_in(session: Session, unflushed: weakref.WeakSet[Any], lock: threading.Lock) -> list[Any]:
    """The jobs of ``unflushed`` (given ``depends_on`` or ``batch``) that are new in ``session``: what its flush
    looks at (a copy under ``lock``: sessions in other threads add and flush at the same time)."""
    if not unflushed:
        return []
    with lock:
        jobs = list(unflushed)
    return [job for job in jobs if (state := instance_state(job)).session_id == session.hash_key and state.key is None]


def driver_of(conn: Connection, jobs: Table) -> Driver:
    key = (type(conn.dialect), jobs)
    driver = _DRIVERS.get(key)
    if driver is None:
        driver = _DRIVERS[key] = driver_for(conn, jobs, _DEAD.get(jobs, jobs))
    return driver


@event.listens_for(Session, "before_flush")
def _before_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    """Check the new dependents of this flush and set their state and count before their INSERT."""
    mine = new_in(session, _UNFLUSHED, _UNFLUSHED_LOCK)
    if not mine:
        return
    # An upstream given only as an object comes with its dependent, and so do its own upstreams. The walk
    # stops at jobs already flushed: their graph is in the table (a chain flushed in parts is not re-read).
    todo, seen = list(mine), {id(job) for job in mine}
    while todo:
        for upstream in todo.pop().depends_on:
            if isinstance(upstream, int) or id(upstream) in seen or instance_state(upstream).key is not None:
                continue
            seen.add(id(upstream))
            if instance_state(upstream).session_id is None:
                session.add(upstream)
                if upstream.depends_on:
                    mine.append(upstream)
            todo.append(upstream)
    _check_cycles(mine)
    by_table: dict[Table, list[Any]] = {}
    for job in mine:
        by_table.setdefault(type(job).__table__, []).append(job)
    conn = session.connection()
    for jobs, members in by_table.items():
        _prepare(conn, jobs, members)
    flush_context.attributes[_INFO_KEY] = mine
    page = conn.get_execution_options().get("insertmanyvalues_page_size", conn.dialect.insertmanyvalues_page_size)
    if page > DEPENDENTS_PAGE:
        # Set on the session's connection for this flush, put back by _after_flush. A flush that fails skips
        # that: a session's own connection is closed with its transaction, but a connection you gave the
        # session keeps the shorter pages (a speed setting only) until you set its option again.
        conn.execution_options(insertmanyvalues_page_size=DEPENDENTS_PAGE)
        flush_context.attributes[_PAGE_KEY] = page


def _prepare(conn: Connection, jobs: Table, dependents: list[Any]) -> None:
    existing: set[int] = set()
    distinct: dict[int, Sequence[Any]] = {}
    for job in dependents:
        # A new job's fields are read from its dict, where one never set is absent (None): the attribute
        # would go through SQLAlchemy's loader machinery, microseconds a read (a sixth of a chain's hooks).
        if instance_dict(job).get("unique_key") is not None:
            raise InvalidJob(f"job {job.kind!r}: a job with depends_on cannot have a unique_key yet "
                             "(its key would not be held while it is blocked); put the key on an upstream")
        ups = distinct[id(job)] = _distinct(job.depends_on)
        for upstream in ups:
            if isinstance(upstream, int):
                existing.add(upstream)
                continue
            if type(upstream).__table__ is not jobs:
                raise InvalidJob(f"job {job.kind!r} depends on a job of table {type(upstream).__table__.name!r}, "
                                 f"not {jobs.name!r}: a dependency stays within one jobs table")
            if instance_state(upstream).key is not None:
                existing.add(upstream.id)
    driver = driver_of(conn, jobs)
    states = driver.lock_upstreams(conn, sorted(existing)) if existing else {}
    missing = existing - states.keys()
    if missing:
        dead = driver.dead_ids(conn, sorted(missing)) if jobs in _DEAD else set()
        first = min(missing)
        if first in dead:
            raise InvalidJob(f"a new job depends on job {first}, which is in the dead letters: requeue it first "
                             "(`sqla-jobs dead retry`), then add the dependent")
        raise InvalidJob(f"a new job depends on job {first}, which is not in table {jobs.name!r} "
                         "(never added, or pruned)")
    for job in dependents:
        waiting = 0
        for upstream in distinct[id(job)]:
            flushed = isinstance(upstream, int) or instance_state(upstream).key is not None
            # A new one is in this flush.
            state, policy = states[_id_of(upstream)] if flushed else (
                "pending", instance_dict(upstream).get("on_upstream_failure"))
            if policy == ERRBACK:
                raise InvalidJob(f"a new job depends on a batch's on_failure callback ({upstream!r}), which is "
                                 "skipped when no member fails; depend on the batch's on_complete callback instead")
            if state == "cancelled" and instance_dict(job).get("on_upstream_failure") not in ("run", "hold"):
                raise InvalidJob(f"a new job depends on job {_id_of(upstream)}, which was cancelled and will never "
                                 "finish (give the dependent on_upstream_failure='run' to run it anyway)")
            if state not in ("finished", "cancelled"):
                waiting += 1
            if not flushed:
                # Stored directly, as Job(...) stores its fields: a new row's INSERT reads the stored values
                # (an attribute event per field was a third of a 10,000-job chain's flush).
                instance_dict(upstream)["has_dependents"] = True
        values = instance_dict(job)
        values[_DISTINCT] = distinct[id(job)]
        if waiting:
            values["state"], values["waiting_for"] = "blocked", waiting


def _distinct(upstreams: Sequence[Any]) -> Sequence[Any]:
    """Each upstream once, in first-given order: a job and its id, or a job given twice, are one dependency."""
    if len(upstreams) == 1:  # a chain's link: the tuple as given (no set, key or list for each of 10,000)
        return upstreams
    seen: set[Any] = set()
    kept = []
    for upstream in upstreams:
        key = upstream if isinstance(upstream, int) else (
            upstream.id if instance_state(upstream).key is not None else ("new", id(upstream)))
        if key not in seen:
            seen.add(key)
            kept.append(upstream)
    return kept


def _check_cycles(dependents: Sequence[Any]) -> None:
    """A cycle can only run through new jobs (an existing job's upstreams are fixed): walk theirs, depth first
    without recursion (a chain of 10,000 new jobs is 10,000 deep). Not at all when every new job's upstreams
    got their own ``depends_on`` before it did (or none): along such edges that moment only goes back, so
    they cannot close a loop. That is how graphs are built, upstreams first."""
    if all(job.__dict__[_SET_AT] > u.__dict__.get(_SET_AT, -1) for job in dependents for u in _new_upstreams(job)):
        return
    done: set[int] = set()
    for start in dependents:
        if id(start) in done:
            continue
        path: list[Any] = [start]
        on_path = {id(start)}
        stack = [iter(_new_upstreams(start))]
        while stack:
            upstream = next(stack[-1], None)
            if upstream is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(id(finished))
                done.add(id(finished))
            elif id(upstream) in on_path:
                loop = path[path.index(upstream):]
                names = " -> ".join(repr(j.kind) for j in [*loop, upstream])
                raise InvalidJob(f"the new jobs' depends_on make a cycle: {names}")
            elif id(upstream) not in done:
                path.append(upstream)
                on_path.add(id(upstream))
                stack.append(iter(_new_upstreams(upstream)))


def _id_of(job: Any) -> int:
    """The id of a flushed job (or an id): from the object's dict, where the INSERT put it (the attribute costs
    microseconds a read); through the attribute for a job flushed earlier and expired since."""
    if isinstance(job, int):
        return job
    found = job.__dict__.get("id")
    return found if found is not None else job.id  # type: ignore[no-any-return]


def _new_upstreams(job: Any) -> list[Any]:
    return [u for u in job.depends_on if not isinstance(u, int) and instance_state(u).key is None]


@event.listens_for(Session, "after_flush")
def _after_flush(session: Session, flush_context: UOWTransaction) -> None:
    """The new dependents have ids now: write their edges, in the same transaction."""
    mine = flush_context.attributes.get(_INFO_KEY)
    if not mine:
        return
    conn = session.connection()
    page = flush_context.attributes.get(_PAGE_KEY)
    if page is not None:
        conn.execution_options(insertmanyvalues_page_size=page)
    by_table: dict[Table, list[tuple[int, int, int]]] = {}
    for job in mine:
        rows = by_table.setdefault(type(job).__table__, [])
        downstream = _id_of(job)
        rows.extend((downstream, position, _id_of(upstream))
                    for position, upstream in enumerate(job.__dict__.pop(_DISTINCT)))
    with _UNFLUSHED_LOCK:  # once, not once per job
        for job in mine:
            _UNFLUSHED.discard(job)
    for jobs, rows in by_table.items():
        driver_of(conn, jobs).add_edges(conn, rows)
