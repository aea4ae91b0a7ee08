"""The dashboard's statements (``sqla_jobs.web``): a keyset page of jobs, dead-job deletion by id, samples;
and the index its lists by queue and by kind need (``list_indexes``).

Portable Core over a driver's tables and clock, so every backend runs the same
statements; nothing here branches on the database, only on whether it has partial indexes (the lists by queue
and by kind: ``column_pages``). Every value a visitor types
(state, kind, queue, a cursor) reaches the database as a bound parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Index,
    Integer,
    Select,
    Table,
    cast,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    union_all,
)

from . import index_dialects_for, partial_where
from .base import Driver

#: Characters of ``last_error`` a job list shows; the job page shows all of it.
ERROR_PREVIEW = 200


#: The states of a job that has ended: its ``finished_at`` is set (by the database clock, after it was created).
ENDED = ("finished", "cancelled")
#: The states of a job that has not ended (a list's branches: each state its own newest page).
LIVE = ("pending", "running", "blocked")
#: The rows of ``list_indexes``, as SQL written out: a query repeats it, since SQLite uses a partial index only for a
#: query that repeats its WHERE word for word (a bound parameter would not match). PostgreSQL proves it from any
#: other state's ``state = :state`` too.
NOT_RUNNING = "state <> 'running'"


def list_indexes(name: str) -> list[Index]:
    """``ix_<jobs>_by_queue_kind``: a queue's jobs, each kind's newest first; a kind's, likewise in each queue.

    A list of a queue or a kind that is rare among a million ended jobs walked the primary key to find a page.
    One index serves both lists (``column_pages``): every row version that enters it costs an entry, so a second
    one, ``(kind, id)`` beside ``(queue, id)``, cost each finish and each enqueue a write (a drain of 30,000 jobs
    ran up to 6 % slower with two; docs/performance.md). Partial where it can be (PostgreSQL, SQLite): the running jobs
    are left out, so a claim (its new row version running) adds no entry. The few running jobs are read through
    their own index. MariaDB/MySQL's leads with ``state``, as its other indexes do: each state's newest page is
    then one range; a range of them all would be sorted whole.
    """
    return [
        Index(f"ix_{name}_by_queue_kind", "queue", "kind", "id", **partial_where(NOT_RUNNING)).ddl_if(
            dialect=index_dialects_for(partial=True)),
        Index(f"ix_{name}_by_queue_kind", "state", "queue", "kind", "id").ddl_if(
            dialect=index_dialects_for(partial=False)),
    ]


def values_of(driver: Driver, conn: Connection, column: str, where: Sequence[ColumnElement[bool]]) -> list[Any]:
    """The distinct values of ``column`` (``queue`` or ``kind``) among the rows ``where`` picks, read along
    ``ix_<jobs>_by_queue_kind`` as a skip scan: one probe a value (the next one above the last), never the rows
    between. Queues and kinds are few, their jobs many. Where the index leads with ``state`` (MariaDB/MySQL), one
    probe a state: a range over several states is read whole, not probed."""
    t = driver.jobs
    col = t.c[column]
    states = [text(NOT_RUNNING)] if driver.partial_indexes else [t.c.state == name for name in (*LIVE, *ENDED)]
    found: list[Any] = []
    while True:
        above = [col > found[-1]] if found else []
        probes = [select(col).where(*where, state, *above).order_by(col).limit(1).subquery() for state in states]
        nexts = union_all(*(select(probe) for probe in probes)).subquery()
        value = conn.execute(select(func.min(nexts.c[column]))).scalar()
        if value is None:
            return found
        found.append(value)


def column_pages(driver: Driver, conn: Connection, newest: Callable[..., Select[Any]], queue: str | None,
                 kind: str | None, state: str | None) -> list[Select[Any]]:
    """The newest pages that make a list of a queue's, a kind's or both's jobs in ``state`` (None: any but
    running), merged by the caller: one range of ``ix_<jobs>_by_queue_kind`` for each (queue, kind) pair the
    list covers (the other column's values read first: ``values_of``), and each state its own range where the
    index leads with ``state`` (MariaDB/MySQL)."""
    t = driver.jobs
    if queue is not None and kind is not None:
        pairs = [(queue, kind)]
    elif queue is not None:
        pairs = [(queue, k) for k in values_of(driver, conn, "kind", [t.c.queue == queue])]
    else:
        pairs = [(q, kind) for q in values_of(driver, conn, "queue", [])]
    pages = []
    for q, k in pairs:
        pair = (t.c.queue == q, t.c.kind == k)
        if driver.partial_indexes:  # the index's WHERE repeated word for word: SQLite uses it only so
            pages.append(newest(*pair, text(NOT_RUNNING), *([] if state is None else [t.c.state == state])))
        else:
            states = [state] if state is not None else [name for name in (*LIVE, *ENDED) if name != "running"]
            pages.extend(driver.by_state(newest(*pair, t.c.state == name)) for name in states)
    return pages


def job_page(
    driver: Driver,
    conn: Connection,
    *,
    state: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    unique_key: str | None = None,
    sequence_key: str | None = None,
    since: float | None = None,
    before_id: int | None = None,
    after: tuple[int, datetime, int] | None = None,
    limit: int = 50,
) -> list[Any]:
    """One page of jobs, at most ``limit``, each with fewer columns than the table (no payload).

    Each list is read along an index that hands rows over in the page's order,
    so a page costs about ``limit`` rows however large the table and wherever
    the matching rows sit in it (docs/howto/dashboard.md, "Speed"):

    * ``state="pending"``: in claim order (priority, then due time, then id:
      next to run first), along the partial index ``ix_<jobs>_pending``; the
      next page starts ``after`` the last row's ``(priority, run_at, id)``.
      Walking the primary key instead read every finished row newer than the
      pending ones: a million of them when a stopped worker left its jobs the oldest rows.
    * any other list: newest first (by id), along the primary key, the next
      page ``before_id`` (the last id shown): page 1000 costs what page 1 costs.
      ``running`` is a few rows, read through its partial index.
    * ``since`` (created within that many seconds), without ``state`` or with an
      ended state: an ended job finished after it was created, so its rows are
      looked up by ``finished_at`` (index ``ix_<jobs>_finished``) and bounded by
      the jobs that ended in the window; without ``state`` the pending, running
      and blocked ones come beside them, each state's newest page by the path its statistics
      favour (no index has their creation time: one would cost every enqueue).
      Before, a window with few jobs (an idle queue) walked the whole table.
    * ``kind`` or ``queue`` (without ``since``): newest first along ``ix_<jobs>_by_queue_kind``
      (``list_indexes``), which holds every job but the running ones: one range for each
      (queue, kind) pair the list covers (``column_pages``), beside the running ones through
      their own index. Before, a kind or queue rare among a million ended jobs walked the
      primary key until a page was found.

    ``unique_key`` matches the key and its periods (``key@<period start>``), as ``jobs list`` does.
    """
    t = driver.jobs
    columns = (
        t.c.id, t.c.kind, t.c.queue, t.c.state, t.c.attempts, t.c.max_attempts, t.c.priority,
        t.c.created_at, t.c.run_at, t.c.finished_at, t.c.locked_by, t.c.unique_key, t.c.sequence_key, t.c.fair_key,
        func.substr(t.c.last_error, 1, ERROR_PREVIEW).label("last_error"),
    )
    filters: list[ColumnElement[bool]] = []
    if kind is not None:
        filters.append(t.c.kind == kind)
    if queue is not None:
        filters.append(t.c.queue == queue)
    if unique_key is not None:
        filters.append(driver.key_or_periods(unique_key))
    if sequence_key is not None:  # sqla_jobs._sequence; along ix_<jobs>_sequence when it is the only filter
        filters.append(t.c.sequence_key == sequence_key)
    if since is not None:
        filters.append(t.c.created_at >= driver.ago(since))

    def newest(*where: ColumnElement[bool]) -> Select[Any]:
        stmt = select(*columns).where(*filters, *where).order_by(t.c.id.desc()).limit(limit)
        return stmt if before_id is None else stmt.where(t.c.id < before_id)

    def in_claim_order(*where: ColumnElement[bool]) -> Select[Any]:
        return (select(*columns).where(t.c.state == "pending", *filters, *where)
                .order_by(t.c.priority.desc(), t.c.run_at, t.c.id).limit(limit))

    if state == "pending":
        if after is None:
            return list(conn.execute(in_claim_order()))
        priority, run_at, last_id = after
        # Two ranges of the index, each read from where the last page stopped: the rest of the
        # last row's priority, then the lower priorities. (A single OR of the two is not an index
        # range: it read the index from its start, so page n cost n pages.) `run_at >= :run_at` is
        # implied by the OR beside it; it is there to be the range.
        same = in_claim_order(t.c.priority == priority, t.c.run_at >= run_at,
                              or_(t.c.run_at > run_at, t.c.id > last_id)).subquery()
        lower = in_claim_order(t.c.priority < priority).subquery()
        both = union_all(select(same), select(lower)).subquery()
        return list(conn.execute(select(both).order_by(both.c.priority.desc(), both.c.run_at, both.c.id)
                                 .limit(limit)))
    if (kind is not None or queue is not None) and since is None and state != "running":
        # A queue's or a kind's jobs along ix_<jobs>_by_queue_kind (list_indexes), the running ones (never in
        # it) through their own index.
        pages = column_pages(driver, conn, newest, queue, kind, state)
        if state is None:
            pages.append(driver.by_state(newest(t.c.state == "running")))
        return _merged(conn, pages, limit) if pages else []
    if since is None or state not in (None, *ENDED):
        return list(conn.execute(newest() if state is None else newest(t.c.state == state)))
    ended = newest(t.c.state.in_(ENDED) if state is None else t.c.state == state,
                   t.c.finished_at >= driver.ago(since))
    if state is not None:
        return list(conn.execute(ended))
    # Each state its own newest page, so the planner picks each one's path by its statistics: a few old
    # pending jobs through their partial index, a large fresh backlog by the primary key. (Without the
    # LIMIT, a fresh backlog was read whole: 58 ms for 300,000 against 9 ms. MariaDB, told to, reads each
    # state's index: by itself it walked the primary key past every finished row to a few old pending jobs.)
    live = [driver.by_state(newest(t.c.state == state)) for state in LIVE]
    return _merged(conn, [*live, ended], limit)


def _merged(conn: Connection, pages: list[Select[Any]], limit: int) -> list[Any]:
    """The newest ``limit`` rows of ``pages``, each already the newest of its own part."""
    merged = union_all(*(select(page.subquery()) for page in pages)).subquery()
    return list(conn.execute(select(merged).order_by(merged.c.id.desc()).limit(limit)))


def job_timings(driver: Driver, conn: Connection, job_id: int) -> Any:
    """Seconds the job waited (claim - due) and ran (finish - claim), by the database clock; None when not yet."""
    t = driver.jobs
    stmt = select(
        driver.seconds_between(t.c.locked_at, t.c.run_at).label("waited"),
        driver.seconds_between(t.c.finished_at, t.c.locked_at).label("ran"),
        driver.seconds_between(t.c.lease_expires_at, driver.now()).label("lease_left"),
    ).where(t.c.id == job_id)
    return conn.execute(stmt).first()


def delete_dead(driver: Driver, conn: Connection, ids: Sequence[int]) -> list[int]:
    """Delete the dead jobs with these ids; returns the ids deleted. A dependent still waiting for one of them
    (``on_upstream_failure="wait"``) hears it was purged, as ``purge_dead`` tells it (``sqla_jobs._graph``)."""
    d = driver.dead
    gone = sorted(r.id for r in conn.execute(delete(d).where(d.c.id.in_(list(ids))).returning(d.c.id)))
    driver.pass_on_failure(conn, gone, "purged")
    return gone


def dead_kinds(driver: Driver, conn: Connection) -> list[Any]:
    """(kind, count) of the dead-letter table, for the kind filter (index ``ix_<dead>_kind``)."""
    d = driver.dead
    return list(conn.execute(select(d.c.kind, func.count().label("count")).group_by(d.c.kind).order_by(d.c.kind)))


# -- samples (sqla_jobs.web._samples) ---------------------------------------------


def sample_age(driver: Driver, conn: Connection, samples: Table) -> float | None:
    """Seconds since the latest sample was written, or None when there is none."""
    latest = select(func.max(samples.c.taken_at)).scalar_subquery()
    age = conn.execute(select(driver.seconds_between(driver.now(), latest))).scalar()
    return None if age is None else float(age)


def write_samples(driver: Driver, conn: Connection, samples: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert one sample's rows (``series``, ``label``, ``value``), stamped with the database clock."""
    if rows:
        conn.execute(insert(samples).values(taken_at=driver.now()), list(rows))


def prune_samples(driver: Driver, conn: Connection, samples: Table, keep: float) -> int:
    """Delete samples older than ``keep`` seconds (uses the ``taken_at`` index)."""
    return conn.execute(delete(samples).where(samples.c.taken_at < driver.ago(keep))).rowcount


def read_samples(driver: Driver, conn: Connection, samples: Table, span: float, step: float) -> list[Any]:
    """The samples of the last ``span`` seconds in buckets of ``step`` seconds, counted back from now:
    (bucket, series, label, largest value in the bucket). Grouped in the database, so a day of
    samples comes back as a few hundred rows per line, not tens of thousands."""
    s = samples
    bucket = cast(driver.seconds_between(driver.now(), s.c.taken_at) / step, Integer).label("bucket")
    stmt = (
        select(bucket, s.c.series, s.c.label, func.max(s.c.value).label("value"))
        .where(s.c.taken_at >= driver.ago(span))
        .group_by(bucket, s.c.series, s.c.label)
    )
    return list(conn.execute(stmt))
