"""The leader lease's statements (``sqla_jobs.leader``): take or renew it, hand it back, read it.

Portable Core over a driver's clock, so every backend runs the same
statements. The lease is one row per name in ``<jobs table>_leader``; whoever
holds an unexpired row is the leader. Taking it over is a single ``UPDATE``
whose ``WHERE`` accepts only the holder itself or an expired row, so two
workers racing for an expired lease cannot both win: the row lock makes the
second one re-read the row, see it taken, and update nothing (PostgreSQL and
MariaDB in READ COMMITTED; SQLite has one writer at a time).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Table, case, insert, select, update
from sqlalchemy.exc import IntegrityError

from .base import Driver


def take_or_renew(driver: Driver, conn: Connection, leader: Table, name: str, holder: str, lease: float) -> int | None:
    """Hold ``name`` for ``lease`` more seconds if ``holder`` has it or it expired; the term, or None.

    The term grows by one each time the lease changes hands or lapses, so a
    leader that lost it and got it back starts a new term.
    """
    t, now = leader, driver.now()
    unbroken = (t.c.holder == holder) & (t.c.expires_at >= now)
    taken = conn.execute(
        update(t)
        .where(t.c.name == name, (t.c.holder == holder) | (t.c.expires_at < now))
        .values(holder=holder, term=case((unbroken, t.c.term), else_=t.c.term + 1), expires_at=driver.later(lease))
    ).rowcount
    if not taken:
        if conn.execute(select(t.c.name).where(t.c.name == name)).first() is not None:
            return None  # held by another worker, unexpired
        try:  # the first worker ever: create the row; of rivals doing the same, one wins here
            with conn.begin_nested():
                conn.execute(insert(t).values(name=name, holder=holder, term=1, expires_at=driver.later(lease)))
        except IntegrityError:
            return None
    term = conn.execute(select(t.c.term).where(t.c.name == name, t.c.holder == holder)).scalar()
    return None if term is None else int(term)


def resign(driver: Driver, conn: Connection, leader: Table, name: str, holder: str, term: int) -> bool:
    """Let the lease lapse now, if ``holder`` still holds it in ``term``: the next worker takes over at once."""
    t = leader
    stmt = update(t).where(t.c.name == name, t.c.holder == holder, t.c.term == term).values(expires_at=driver.ago(1.0))
    return bool(conn.execute(stmt).rowcount)


def current(driver: Driver, conn: Connection, leader: Table, name: str) -> Any:
    """(holder, term, seconds left: negative once expired) of ``name``'s lease, or None if nobody ever held it."""
    t = leader
    left = driver.seconds_between(t.c.expires_at, driver.now()).label("seconds_left")
    return conn.execute(select(t.c.holder, t.c.term, left).where(t.c.name == name)).first()
