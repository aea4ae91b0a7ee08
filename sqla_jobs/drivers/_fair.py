"""A fair queue's claim (``sqla_jobs._fair``), portable: SQLite and MariaDB/MySQL (mixed into ``Driver``).

The same turns as PostgreSQL's one statement (``drivers/postgresql/fair.py``), as a few short statements in
the claim's transaction:

1. **The ring.** From the claimer's cursor (the last key it served), step to each next key with one
   ``MIN(fair_key) … WHERE fair_key > :previous`` on ``ix_<table>_fair``: one index probe per key, so the
   walk costs O(keys walked), at most ``limit`` of them, however many pending jobs or keys the queue holds.
   When the keys run out the ring wraps: the keyless turn (jobs without a ``fair_key``), then the keys up to
   the cursor.
2. **The turns.** ``rounds`` rounds of the keys found fill the claim; each key gives its ``weight * rounds``
   most urgent due jobs (``FOR UPDATE SKIP LOCKED`` on MariaDB; SQLite's ``BEGIN IMMEDIATE`` already keeps
   every other writer out). Taken round by round in ring order, ``limit`` of them.
3. **Top-up.** A claim left short while a key still had jobs asks once more from the cursor (a lone big key
   drains at full speed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Select, Table, exists, func, literal, select, update
from sqlalchemy.sql.elements import ColumnElement

from ._claimed import Claimed, Fence

__all__ = ["Fairness"]

#: How many times a short claim asks again (each at least one job more, or it stops).
_TOP_UPS = 2


class Fairness:
    """``claim_fair``: see ``Driver.claim_fair``'s description here."""

    jobs: Table

    if TYPE_CHECKING:  # Driver's own (declared here for the type checker only: Driver must win the MRO)
        def now(self) -> ColumnElement[datetime]: ...
        def later(self, seconds: float) -> ColumnElement[datetime]: ...
        def skip_locked(self, stmt: Select[Any]) -> Select[Any]: ...
        def finish(self, conn: Connection, fences: Sequence[Fence]) -> set[int]: ...

    def claim_fair(self, conn: Connection, queue: str, weights: Mapping[str, int], after: str, limit: int,
                   worker: str, token: str, lease: float, alone: bool,
                   skip_kinds: Sequence[str] = ()) -> tuple[list[Claimed], bool, str]:
        """Claim up to ``limit`` due jobs of fair queue ``queue``, its keys taking turns in the ring after
        ``after`` (the last key this claimer served, "" at first): ``weights[key]`` (default 1) jobs a turn,
        the keyless jobs one turn where the ring wraps. Returns (claimed in turn order, isolated_waiting, the
        new cursor). Isolated jobs follow ``Driver.finish_and_claim``'s rule."""
        claimed: list[Claimed] = []
        waiting = False
        for _ in range(1 + _TOP_UPS):
            if len(claimed) >= limit:
                break
            jobs, left, after, more = self._fair_turns(conn, queue, weights, after, limit - len(claimed), worker,
                                                       token, lease, alone and not claimed, skip_kinds)
            claimed += jobs
            waiting = waiting or left
            if not jobs or not more or (jobs and jobs[0].isolated):
                break
        return claimed, waiting, after

    def finish_and_claim_fair(self, conn: Connection, fences: Sequence[Fence], queue: str, weights: Mapping[str, int],
                              after: str, limit: int, worker: str, token: str, lease: float, alone: bool,
                              skip_kinds: Sequence[str] = ()) -> tuple[set[int], list[Claimed], bool, str]:
        """Mark ``fences`` finished, then ``claim_fair``: (finished ids, claimed, isolated_waiting, cursor). One
        transaction here; on PostgreSQL one statement (the worker's turn, one round trip)."""
        finished = self.finish(conn, fences)
        return (finished, *self.claim_fair(conn, queue, weights, after, limit, worker, token, lease, alone,
                                           skip_kinds))

    def _in_turn_order(self, due: Select[Any]) -> Select[Any]:
        """``due`` (one key's pending jobs) most urgent first, walked on ``ix_<table>_fair``: led by queue and key
        (fixed by the WHERE, so the order is the same), the order of that index alone, so that SQLite never walks
        the plain pending index past every other key's jobs instead."""
        t = self.jobs
        return due.order_by(t.c.queue, t.c.fair_key, t.c.priority.desc(), t.c.run_at, t.c.id)

    def _take_turns(self, conn: Connection, turns: list[Select[Any]]) -> list[Any]:
        """The rows of each key's turn (a locking ``turns`` statement each): one statement after another."""
        return [row for turn in turns for row in conn.execute(turn)]

    def _keys_after(self, conn: Connection, queue: str, after: str, count: int, upto: str | None) -> list[str]:
        """Up to ``count`` keys with pending jobs in ``queue``, in order, after ``after`` (and up to ``upto``): one
        index probe each, the next key after the one before."""
        t = self.jobs
        keys: list[str] = []
        while len(keys) < count:
            nxt = conn.execute(select(func.min(t.c.fair_key)).where(
                t.c.state == "pending", t.c.queue == queue, t.c.fair_key > (keys[-1] if keys else after))).scalar()
            if nxt is None or (upto is not None and nxt > upto):
                break
            keys.append(nxt)
        return keys

    def _fair_ring(self, conn: Connection, queue: str, after: str, count: int) -> list[str | None]:
        """Up to ``count`` keys with pending jobs in ring order after ``after``, the keyless turn at the wrap."""
        t = self.jobs
        # The keyless turn sits where the ring wraps (its jobs take turns too), one more than ``count``; then
        # round the ring once: the keys up to the cursor.
        ring: list[str | None] = [*self._keys_after(conn, queue, after, count, None), None]
        if len(ring) - 1 < count:
            ring += self._keys_after(conn, queue, "", count - len(ring) + 1, after)
        pending = (t.c.state == "pending", t.c.queue == queue)
        if not conn.execute(select(exists().where(*pending, t.c.fair_key.is_(None)))).scalar():
            ring.remove(None)  # none to offer: it would thin out every key's share of the claim
        return ring

    def _fair_turns(self, conn: Connection, queue: str, weights: Mapping[str, int], after: str, limit: int,
                    worker: str, token: str, lease: float, alone: bool,
                    skip_kinds: Sequence[str]) -> tuple[list[Claimed], bool, str, bool]:
        """One pass of the ring: (claimed, isolated_waiting, cursor, some key had more than its turns)."""
        t = self.jobs
        ring = self._fair_ring(conn, queue, after, limit)
        if not ring:
            return [], False, after, False
        shares = [weights.get(key, 1) if key is not None else 1 for key in ring]  # the keyless turn weighs 1
        rounds = math.ceil(limit / sum(shares))
        sizes = [share * rounds for share in shares]  # each turn's jobs
        turns = []
        for place, key in enumerate(ring):
            due = select(t.c.id, t.c.kind, t.c.queue, t.c.payload, t.c.attempts, t.c.max_attempts, t.c.priority,
                         t.c.isolate, t.c.fair_key, literal(place).label("place")).where(
                t.c.state == "pending", t.c.queue == queue, t.c.run_at <= self.now(),
                t.c.fair_key == key if key is not None else t.c.fair_key.is_(None))
            if skip_kinds:
                due = due.where(t.c.kind.not_in(list(skip_kinds)))
            turns.append(self.skip_locked(self._in_turn_order(due).limit(sizes[place])))
        taken: list[list[Any]] = [[] for _ in ring]
        for row in self._take_turns(conn, turns):
            taken[row.place].append(row)
        more = any(len(rows) == size for rows, size in zip(taken, sizes, strict=True))
        window: list[tuple[int, int, int, Any]] = []  # (round, place in the ring, n, row)
        for place, rows in enumerate(taken):
            window += [(n // shares[place], place, n, r) for n, r in enumerate(rows)]
        window.sort(key=lambda w: w[:3])
        rows = [w[3] for w in window[:limit]]
        isolated = [r for r in rows if r.isolate]
        if alone and isolated:
            chosen, waiting = isolated[:1], len(isolated) > 1
        else:
            chosen, waiting = [r for r in rows if not r.isolate], bool(isolated)
        if not chosen:
            return [], waiting, after, False
        # The rows are ours: locked above (FOR UPDATE SKIP LOCKED), or under SQLite's write lock.
        conn.execute(update(t).where(t.c.id.in_([r.id for r in chosen])).values(
            state="running", attempts=t.c.attempts + 1, locked_at=self.now(), locked_by=worker, claim_token=token,
            lease_expires_at=self.later(lease)))
        jobs = [Claimed(r.id, r.kind, r.queue, r.payload, r.attempts + 1, r.max_attempts, r.priority, token,
                        bool(r.isolate)) for r in chosen]
        return jobs, waiting, chosen[-1].fair_key or "", more
