"""The dashboard's statements (``sqla_jobs.web``): a keyset page of jobs, dead-job deletion by id, samples.

Portable Core over a driver's tables and clock, so every backend runs the same
statements; nothing here branches on the database. Every value a visitor types
(state, kind, queue, a cursor) reaches the database as a bound parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Integer, Table, cast, delete, func, insert, select

from .base import Driver

#: Characters of ``last_error`` a job list shows; the job page shows all of it.
ERROR_PREVIEW = 200


def job_page(
    driver: Driver,
    conn: Connection,
    *,
    state: str | None = None,
    kind: str | None = None,
    queue: str | None = None,
    unique_key: str | None = None,
    since: float | None = None,
    before_id: int | None = None,
    limit: int = 50,
) -> list[Any]:
    """Jobs newest first (by id), at most ``limit``, each with fewer columns than the table (no payload).

    Keyset pagination: the next page starts ``before_id`` (the last id shown), so
    page 1000 costs what page 1 costs, walking the primary key backwards; no
    OFFSET and no COUNT over a million rows. ``since``: created within that many seconds.
    ``unique_key`` matches the key and its periods (``key@<period start>``), as ``jobs list`` does.
    """
    t = driver.jobs
    stmt = (
        select(
            t.c.id, t.c.kind, t.c.queue, t.c.state, t.c.attempts, t.c.max_attempts, t.c.priority,
            t.c.created_at, t.c.run_at, t.c.finished_at, t.c.locked_by, t.c.unique_key,
            func.substr(t.c.last_error, 1, ERROR_PREVIEW).label("last_error"),
        )
        .order_by(t.c.id.desc())
        .limit(limit)
    )
    if state is not None:
        stmt = stmt.where(t.c.state == state)
    if kind is not None:
        stmt = stmt.where(t.c.kind == kind)
    if queue is not None:
        stmt = stmt.where(t.c.queue == queue)
    if unique_key is not None:
        stmt = stmt.where(driver.key_or_periods(unique_key))
    if since is not None:
        stmt = stmt.where(t.c.created_at >= driver.ago(since))
    if before_id is not None:
        stmt = stmt.where(t.c.id < before_id)
    return list(conn.execute(stmt))


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
    """Delete the dead jobs with these ids; returns the ids deleted."""
    d = driver.dead
    return sorted(r.id for r in conn.execute(delete(d).where(d.c.id.in_(list(ids))).returning(d.c.id)))


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
