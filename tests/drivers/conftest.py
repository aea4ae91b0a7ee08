"""The driver conformance suite: every registered driver runs every test here, unchanged.

A new backend is done when this suite passes with its dialect name added to
``tests.conftest.BACKENDS`` (``test_registry.py`` fails while a registered
driver is missing from that list). The tests talk to the driver directly,
as the worker and ``JobQueue`` do, on a real database.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, select, update

from sqla_jobs.drivers import Driver
from sqla_jobs.drivers.base import Claimed
from tests import app
from tests.conftest import BACKENDS, MODES, Database, make_database


@dataclass
class Backend:
    """One database with the test app's tables, and its driver."""

    db: Database
    driver: Driver

    @property
    def name(self) -> str:
        return self.db.backend

    def insert(self, n: int = 1, **fields: Any) -> list[int]:
        """Commit ``n`` jobs through ``insert_many``; returns their ids (ascending)."""
        rows = [
            {"kind": "noop", "queue": "default", "payload": json.dumps({"i": i}), "priority": 0,
             "max_attempts": 5, "run_at": None, **fields}
            for i in range(n)
        ]
        t = self.driver.jobs
        with self.driver.write(self.db.engine) as conn:
            before = conn.execute(select(t.c.id).order_by(t.c.id.desc()).limit(1)).scalar() or 0
            self.driver.insert_many(conn, rows)
            return list(conn.execute(select(t.c.id).where(t.c.id > before).order_by(t.c.id)).scalars())

    def claim(self, limit: int = 10, queues: list[str] | None = None, lease: float = 60.0) -> list[Claimed]:
        with self.driver.write(self.db.engine) as conn:
            return self.driver.claim(conn, limit, "conformance", uuid.uuid4().hex, lease, queues)

    def row(self, job_id: int) -> Any:
        with self.db.engine.connect() as conn:
            return self.driver.get_job(conn, job_id)

    def dead_row(self, job_id: int) -> Any:
        with self.db.engine.connect() as conn:
            return self.driver.get_dead(conn, job_id)

    def set(self, job_id: int, **values: Any) -> None:
        """Change a job's columns directly (e.g. to age a lease) in a committed write."""
        t = self.driver.jobs
        with self.driver.write(self.db.engine) as conn:
            conn.execute(update(t).where(t.c.id == job_id).values(**values))

    def scalar(self, expression: Any) -> Any:
        with self.db.engine.connect() as conn:
            return conn.execute(select(expression)).scalar()

    def write(self) -> Any:
        return self.driver.write(self.db.engine)

    def now(self) -> datetime:
        return self.scalar(self.driver.now())  # type: ignore[no-any-return]


@pytest.fixture(params=BACKENDS + MODES)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    for database in make_database(request.param, tmp_path):
        app.queue.create_tables(database.engine, partitioned=database.partitioned)
        yield Backend(database, app.queue.driver(database.engine))


def in_write(backend: Backend, action: Any) -> Any:
    """Run ``action(conn)`` in one committed write transaction and return its result."""
    conn: Connection
    with backend.write() as conn:
        return action(conn)


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each of ``calls`` in a thread of its own, all let go at the same instant: what each returned or raised,
    in the order of ``calls`` (a race the database must settle, for the caller to judge)."""
    start = threading.Barrier(len(calls))
    outcomes: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        start.wait()
        try:
            outcomes[i] = calls[i]()
        except Exception as exc:  # the caller's to judge
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes
