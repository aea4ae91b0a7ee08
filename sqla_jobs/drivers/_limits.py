"""The claim of kinds with limits (``sqla_jobs._limits``): running at once, per payload key, starts per period.

The worker's ordinary claim skips these kinds (``skip_kinds``); ``claim_limited``
takes them, in a write transaction of its own (``Driver.write``), one kind after
the other in kind order:

1. **Lock the kind's row** in ``<jobs table>_limits`` (``SELECT … FOR UPDATE``),
   creating it on first use. Every claimer of the kind, in any worker, waits
   here for the one before it to commit. Why a row lock and not a count in
   the claim's ``WHERE``: under READ COMMITTED (PostgreSQL, and MariaDB as
   ``begin_write`` sets it) two claimers can each count 2 running jobs under
   a limit of 3 and each take one, ending with 4 running. Serialising the
   claimers of a limited kind closes that: a claimer counts only after the
   previous one committed, and each statement of a READ COMMITTED
   transaction sees every commit made before it began. Why a row, not
   ``pg_advisory_xact_lock``: one mechanism on all three databases
   (MariaDB's ``GET_LOCK`` belongs to the session, not the transaction), it
   works behind PgBouncer in transaction mode, and the rate's token bucket
   needs a row anyway. On SQLite the claim's ``BEGIN IMMEDIATE`` already
   serialises every writer; ``FOR UPDATE`` is left out there.
2. **Count** the kind's ``running`` jobs (per key with ``limit_key``, the
   payload field read by the database). Only a claim makes a job running,
   and every claim of the kind holds the lock, so the count cannot grow
   until this transaction ends; finishes and retries that make it shrink
   only leave the claim more cautious than it needs to be. A job whose
   worker died counts until the reaper hands it back.
3. **Refill the bucket** (a rate): ``tokens + elapsed * count / period``,
   capped at ``count``, with the elapsed time from the database clock.
4. **Claim** at most what the limit, the bucket and the worker's free
   threads allow: the due jobs of the kind in claim order, ``SKIP LOCKED``,
   leaving keys that are full; then write the bucket back.

Before step 1, a read without locks (``_worth_locking``) skips a kind with
nothing due, at its limit, or with an empty bucket, so that workers polling a
full kind do not queue for its row.

A kind with a plain running limit (no key, no rate) goes to the backend's own
way first (``Driver.claim_capped``): PostgreSQL sends the same steps as two
statements in one round trip (``pg_limits``); the others, and a kind whose row
does not exist yet, take the steps above. A worker whose limits are all plain
may make its whole turn the backend's way (``Driver.finish_and_claim_capped``,
called by ``sqla_jobs.worker.store``).

Jobs left over wait ``pending`` with their attempts untouched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Table, exists, func, literal, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.elements import ColumnElement

from .base import Claimed, Driver

__all__ = ["LimitSpec", "claim_limited", "ensure_rows", "payload_key", "running_counts"]

#: With a per-key limit, how many due jobs a claim looks at per free thread (keys that are full are left out by
#: the query; this bounds the rows locked and read when the window holds several jobs of one key).
_KEY_WINDOW = 4


class LimitSpec(Protocol):
    """What the claim needs of a kind's limits (``sqla_jobs._limits.KindLimit``)."""

    @property
    def kind(self) -> str: ...

    @property
    def running(self) -> int | None: ...

    @property
    def key(self) -> str | None: ...

    @property
    def rate_count(self) -> int | None: ...

    @property
    def refill(self) -> float: ...

    @property
    def row(self) -> str: ...


#: How often ensure_rows runs its transaction again after losing a race (a deadlock) to another worker.
ENSURE_ATTEMPTS = 5


def payload_key(driver: Driver, field: str) -> ColumnElement[str]:
    """A top-level payload field as text, '' when it is missing, computed by the database.

    ``field`` was checked when the handler was registered (letters, digits, ``_``, ``-``), so it may sit in the
    JSON path's text.
    """
    value = driver.json_field_text(driver.jobs.c.payload, field)  # each backend spells it its own way
    return func.coalesce(value, literal(""))


def running_counts(driver: Driver, conn: Connection, limit: LimitSpec) -> dict[str, int]:
    """Running jobs of the kind: {"": n} without a key, else per key."""
    t = driver.jobs
    if limit.key is None:
        stmt = select(literal(""), func.count()).where(t.c.state == "running", t.c.kind == limit.kind)
    else:
        key = payload_key(driver, limit.key)
        stmt = select(key, func.count()).where(t.c.state == "running", t.c.kind == limit.kind).group_by(key)
    return {str(k): int(n) for k, n in conn.execute(stmt)}


def _lock_row(driver: Driver, conn: Connection, table: Table, name: str) -> Any:
    """The kind's limits row, locked until the transaction ends (created on first use): (tokens, elapsed)."""
    elapsed = driver.seconds_between(driver.now(), table.c.updated_at).label("elapsed")
    stmt = select(table.c.tokens, elapsed).where(table.c.name == name).with_for_update()
    row = conn.execute(stmt).first()
    if row is None:
        # The first claim of the kind ever; of rivals doing the same, one inserts and the others wait for it.
        # An upsert, not an INSERT whose duplicate-key error is caught: on InnoDB that error leaves the loser a
        # shared lock on the winner's row, which the FOR UPDATE below must then upgrade behind the other
        # claimers' requests for the row: a deadlock. ON DUPLICATE KEY UPDATE takes the exclusive lock at once.
        driver.upsert(conn, table, {"name": name, "tokens": None, "updated_at": driver.now()})
        row = conn.execute(stmt).one()
    return row


def claim_limited(
    driver: Driver,
    conn: Connection,
    table: Table,
    limits: Sequence[LimitSpec],
    free: int,
    worker: str,
    token: str,
    lease: float,
    queues: Sequence[str] | None,
    alone: bool,
) -> tuple[list[Claimed], bool, bool]:
    """Claim up to ``free`` jobs of the limited kinds in ``conn``'s write transaction (see the module docstring).

    Returns (claimed, isolated_waiting, took_isolated): isolated jobs follow
    ``Driver.finish_and_claim``'s rule; ``took_isolated`` says the one job
    claimed must run alone, so nothing else may be claimed this turn.
    """
    claimed: list[Claimed] = []
    waiting = False
    budget0, alone0 = free, alone  # the backend's own claim counts what this claim (token) took before
    for limit in sorted(limits, key=lambda lim: lim.kind):  # one order for every claimer: no lock cycles
        if free <= 0:
            break
        if limit.running is not None and limit.key is None and not limit.rate_count:
            fast = driver.claim_capped(conn, table, limit.row, limit.kind, limit.running, budget0, worker, token,
                                    lease, queues, alone0)
            if fast is not None:  # the backend's own way (PostgreSQL: drivers/postgresql/capped.py)
                jobs, left = fast
                waiting = waiting or left
                claimed += jobs
                free -= len(jobs)
                if alone and jobs and jobs[0].isolated:
                    return claimed, waiting, True
                alone = alone and not jobs
                continue
        if not _worth_locking(driver, conn, table, limit, queues):
            continue
        row = _lock_row(driver, conn, table, limit.row)
        budget = free
        tokens = None
        if limit.rate_count:
            elapsed = float(row.elapsed) if row.elapsed is not None else 0.0
            held = float(limit.rate_count) if row.tokens is None else float(row.tokens)
            tokens = min(float(limit.rate_count), held + max(elapsed, 0.0) * limit.refill)
            budget = min(budget, math.floor(tokens + 1e-9))
        room: dict[str, int] | None = None
        if limit.running is not None:
            counts = running_counts(driver, conn, limit)
            if limit.key is None:
                budget = min(budget, limit.running - counts.get("", 0))
            else:
                room = {k: limit.running - n for k, n in counts.items()}
        if budget > 0:
            jobs, left, lone = _take(driver, conn, limit, budget, room, worker, token, lease, queues, alone)
            waiting = waiting or left
            claimed += jobs
            free -= len(jobs)
            if lone:
                _save_bucket(driver, conn, table, limit.row, row, tokens, len(jobs))
                return claimed, waiting, True
            alone = alone and not jobs
        else:
            jobs = []
        _save_bucket(driver, conn, table, limit.row, row, tokens, len(jobs))
    return claimed, waiting, False


def ensure_rows(driver: Driver, engine: Engine, table: Table, names: Sequence[str]) -> None:
    """Create the limits rows ``names`` if missing (the backend's own claim, ``Driver.finish_and_claim_capped``,
    locks them but does not create them).

    Workers starting together race for the same missing rows, in the same (sorted) order, each creating a
    missing one with an upsert (``_lock_row``): they wait for each other. Should the database still end one
    of them as a deadlock or a lock wait timeout (a loaded InnoDB), nothing is wrong: the transaction is
    run again.
    """
    for attempt in range(1, ENSURE_ATTEMPTS + 1):
        try:
            with driver.write(engine) as conn:
                for name in sorted(names):
                    _lock_row(driver, conn, table, name)
            return
        except DBAPIError as exc:
            if attempt == ENSURE_ATTEMPTS or not driver.is_conflict(exc):
                raise
            time.sleep(0.02 * attempt)


def _worth_locking(driver: Driver, conn: Connection, table: Table, limit: LimitSpec,
                   queues: Sequence[str] | None) -> bool:
    """Whether the kind may have a job to claim, read without any lock: is one due, is the kind below its
    limit, does its bucket hold a token.

    A "no" is safe without the lock (running jobs and spent tokens only grow under it, so what is full now
    stays full until this transaction ends, and a job enqueued meanwhile waits for the next claim); a "yes" is
    checked again under it. It keeps claimers that have nothing to take off the kind's row: with the kind at
    its limit, every worker's poll would otherwise queue for the lock behind the others.
    """
    t = driver.jobs
    due = select(t.c.id).where(t.c.state == "pending", t.c.run_at <= driver.now(), t.c.kind == limit.kind)
    if queues:
        due = due.where(t.c.queue.in_(list(queues)))
    columns: list[Any] = [exists(due)]
    if limit.running is not None and limit.key is None:
        running = select(func.count()).where(t.c.state == "running", t.c.kind == limit.kind)
        columns.append(running.scalar_subquery())
    row = conn.execute(select(*columns)).one()
    if not row[0] or (len(row) > 1 and limit.running is not None and row[1] >= limit.running):
        return False
    if limit.rate_count:
        elapsed = driver.seconds_between(driver.now(), table.c.updated_at)
        bucket = conn.execute(select(table.c.tokens, elapsed).where(table.c.name == limit.row)).first()
        if bucket is not None and bucket[0] is not None and bucket[1] is not None:
            return float(bucket[0]) + max(float(bucket[1]), 0.0) * limit.refill >= 1.0 - 1e-9
    return True


def _take(
    driver: Driver,
    conn: Connection,
    limit: LimitSpec,
    budget: int,
    room: dict[str, int] | None,
    worker: str,
    token: str,
    lease: float,
    queues: Sequence[str] | None,
    alone: bool,
) -> tuple[list[Claimed], bool, bool]:
    """The due jobs of one kind, in claim order, within ``budget`` and each key's ``room``."""
    t = driver.jobs
    key = payload_key(driver, limit.key) if limit.key is not None else literal("")
    due = select(t.c.id, t.c.kind, t.c.queue, t.c.payload, t.c.attempts, t.c.max_attempts, t.c.priority,
                 t.c.isolate, key.label("limit_key")).where(
        t.c.state == "pending", t.c.run_at <= driver.now(), t.c.kind == limit.kind)
    if queues:
        due = due.where(t.c.queue.in_(list(queues)))
    window = budget
    if room is not None:
        full = sorted(k for k, r in room.items() if r <= 0)
        if full:
            due = due.where(key.not_in(full))
        window = budget * _KEY_WINDOW
    due = due.order_by(t.c.priority.desc(), t.c.run_at, t.c.id).limit(window)
    rows = list(conn.execute(driver.skip_locked(due)))
    isolated = [r for r in rows if r.isolate]
    if alone and isolated:
        chosen, waiting, lone = isolated[:1], len(isolated) > 1, True
    else:
        chosen, waiting, lone = [], bool(isolated), False
        for r in rows:
            if len(chosen) >= budget:
                break
            if r.isolate:
                continue
            if room is not None:
                left = room.get(r.limit_key, limit.running or 0)
                if left <= 0:
                    continue
                room[r.limit_key] = left - 1
            chosen.append(r)
    if not chosen:
        return [], waiting, False
    # The rows are ours: locked above (FOR UPDATE SKIP LOCKED), or under SQLite's write lock.
    conn.execute(update(t).where(t.c.id.in_([r.id for r in chosen])).values(
        state="running", attempts=t.c.attempts + 1, locked_at=driver.now(), locked_by=worker, claim_token=token,
        lease_expires_at=driver.later(lease)))
    jobs = [Claimed(r.id, r.kind, r.queue, r.payload, r.attempts + 1, r.max_attempts, r.priority, token,
                    bool(r.isolate)) for r in chosen]
    return jobs, waiting, lone


def _save_bucket(driver: Driver, conn: Connection, table: Table, name: str, row: Any, tokens: float | None,
                 taken: int) -> None:
    """Write the rate's bucket back: the refilled tokens less those taken, as of now.

    A negative elapsed time (PostgreSQL's ``now()`` is when the transaction began, which can be before the
    claimer that held the lock wrote its time) refilled nothing, so the stored time is kept: time counted once.
    """
    if tokens is None:
        return
    values: dict[str, Any] = {"tokens": tokens - taken}
    if row.elapsed is None or float(row.elapsed) >= 0:
        values["updated_at"] = driver.now()
    conn.execute(update(table).where(table.c.name == name).values(**values))
