"""The vacuum hooks (``Driver.dead_rows``, ``may_vacuum``, ``vacuum``): PostgreSQL counts the jobs table's
dead rows (a partitioned table's over its partitions) and a VACUUM reclaims them; the other backends
reclaim them themselves and say so with None."""

from __future__ import annotations

import time

from tests.drivers.conftest import Backend, in_write


def _dead_rows(backend: Backend) -> int | None:
    with backend.db.engine.connect() as conn:
        return backend.driver.dead_rows(conn)


def _wait_for(backend: Backend, test: object, seconds: float = 15.0) -> int | None:
    """The dead-row count once ``test(count)`` holds (the server's statistics lag by about a second)."""
    deadline = time.monotonic() + seconds
    while True:
        dead = _dead_rows(backend)
        if test(dead) or time.monotonic() > deadline:  # type: ignore[operator]
            return dead
        time.sleep(0.2)


def test_dead_rows_are_counted_and_a_vacuum_reclaims_them(backend: Backend) -> None:
    backend.insert(300)
    claimed = backend.claim(300)
    in_write(backend, lambda c: backend.driver.finish(c, [j.fence for j in claimed]))
    if backend.name != "postgresql":
        assert _dead_rows(backend) is None
        return
    assert _wait_for(backend, lambda n: n >= 600) >= 600  # each job: its claim's and its finish's old version
    with backend.db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        assert backend.driver.may_vacuum(conn)  # the suite's role owns the tables
        backend.driver.vacuum(conn)
    assert _wait_for(backend, lambda n: n == 0) == 0
    assert all(backend.row(j.id).state == "finished" for j in claimed)  # the live rows are untouched
