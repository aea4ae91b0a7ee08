"""The enqueue half of ``sqla-jobs bench``: how fast jobs go in, each way an app can add them.

Every function times one way against the bench's own tables (``sqla_jobs.bench.app``)
and returns jobs per second, or microseconds per job for the request figure:

* ``enqueue_single``: one job per transaction through the ``Session``, and the same
  ``INSERT`` through SQLAlchemy Core on one connection;
* ``driver_single``: the same transactions through the DBAPI driver alone (``BEGIN``,
  ``INSERT``, ``COMMIT``, nothing of SQLAlchemy in between): the ceiling of any layer
  on that driver, the ``Session`` included;
* ``enqueue_add_all``: ``session.add_all`` of ``n`` jobs in one transaction, for ``Job``
  or for ``PlainJob``, the same table mapped bare (the floor);
* ``enqueue_beside_business_row``: what one job adds to a transaction that writes a
  business row, through the ``Session`` and as a raw ``INSERT``;
* ``enqueue_fast``: ``queue.enqueue_many`` (COPY on PostgreSQL).

The ceiling is there to read the ``Session``'s figure against: a peer whose single
enqueue beats the driver's own transaction is out of reach of any transactional
enqueue on that driver, whatever sqla-jobs does (docs/performance.md, "Enqueue through
the ORM").
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Engine, TextClause, text
from sqlalchemy.orm import Session

from .app import BenchJob, BenchOrder, PlainJob, queue

__all__ = ["driver_single", "enqueue_add_all", "enqueue_beside_business_row", "enqueue_fast",
           "enqueue_single"]


def enqueue_single(engine: Engine, n: int) -> tuple[float, float]:
    """Jobs/s for one ORM job per transaction, and for the same insert in raw SQL."""
    start = time.perf_counter()
    for i in range(n):
        with Session(engine) as session, session.begin():
            session.add(BenchJob(kind="noop", payload={"i": i}))
    orm = n / (time.perf_counter() - start)
    sql = _raw_insert()
    start = time.perf_counter()
    with engine.connect() as conn:
        for i in range(n):
            conn.execute(sql, {"p": json.dumps({"i": i})})
            conn.commit()
    raw = n / (time.perf_counter() - start)
    return orm, raw


def driver_single(engine: Engine, n: int) -> float:
    """Jobs/s for one-job transactions on the DBAPI connection alone, in the driver's own parameter style."""
    compiled = _raw_insert().compile(dialect=engine.dialect)
    positional = engine.dialect.positional
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        start = time.perf_counter()
        for i in range(n):
            payload = json.dumps({"i": i})
            cursor.execute(compiled.string, (payload,) if positional else {"p": payload})
            raw.commit()  # the driver began the transaction itself, before the INSERT, as under a Session
        return n / (time.perf_counter() - start)
    finally:
        raw.close()


def _raw_insert() -> TextClause:
    return text(f"INSERT INTO {BenchJob.__table__.name} (kind, payload) VALUES ('noop', :p)")


def enqueue_add_all(engine: Engine, n: int, model: Any = BenchJob) -> float:
    start = time.perf_counter()
    with Session(engine) as session, session.begin():
        session.add_all([model(kind="noop", payload={"i": i}) for i in range(n)])
    return n / (time.perf_counter() - start)


def enqueue_beside_business_row(engine: Engine, n: int) -> dict[str, float]:
    """Microseconds one job adds to a transaction that writes a business row, by how it is written.

    ``job``: ``session.add(Job(...))``; ``plain``: the same row through the bare
    mapping (the floor); ``raw``: an ``INSERT`` on the Session's connection. The
    kinds of transaction (and the business row alone) take turns in blocks of 50,
    each kind first in turn, so that a slow patch of a shared machine falls on all alike.
    """
    sql = _raw_insert()
    kinds = ("alone", "job", "plain", "raw")
    spent = dict.fromkeys(kinds, 0.0)
    block = 50
    rounds = max(1, n // block)
    for r in range(rounds):
        for kind in kinds[r % 4:] + kinds[:r % 4]:
            start = time.perf_counter()
            for i in range(r * block, (r + 1) * block):
                with Session(engine) as session, session.begin():
                    session.add(BenchOrder(note="order"))
                    if kind == "job":
                        session.add(BenchJob(kind="noop", payload={"i": i}))
                    elif kind == "plain":
                        session.add(PlainJob(kind="noop", payload={"i": i}))
                    elif kind == "raw":
                        session.connection().execute(sql, {"p": json.dumps({"i": i})})
            spent[kind] += time.perf_counter() - start
    per = 1e6 / (rounds * block)
    return {kind: (spent[kind] - spent["alone"]) * per for kind in kinds[1:]}


def enqueue_fast(engine: Engine, n: int) -> float:
    start = time.perf_counter()
    with Session(engine) as session, session.begin():
        queue.enqueue_many(session, ({"kind": "noop", "payload": {"i": i}} for i in range(n)))
    return n / (time.perf_counter() - start)
