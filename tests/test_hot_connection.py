"""The worker's hot connection (``Store.hot``): its isolation, its commits, and that it leaves the pool clean.

On PostgreSQL it is one autocommit connection; on MariaDB one connection kept at
READ COMMITTED (no gap locks), each use committed by the store; on SQLite there
is none, and each use is a ``Driver.write`` transaction.
"""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sqla_jobs.worker.store import Store

from . import app
from .conftest import Database

EXPECTED = {"postgresql": "AUTOCOMMIT", "mariadb": "READ COMMITTED", "sqlite": None}


def _enqueue(db: Database, n: int) -> None:
    with Session(db.engine) as session, session.begin():
        session.add_all([app.Job(kind="noop", payload={"n": i}) for i in range(n)])


def test_the_hot_connection_has_the_drivers_isolation_and_commits_each_claim(db: Database) -> None:
    sql = app.queue.driver(db.engine)
    assert sql.hot_isolation == EXPECTED[db.backend]
    _enqueue(db, 3)
    store = Store(db.engine, app.queue, sql, "hot-test", 60.0, None)
    try:
        with store.hot() as conn:
            if db.backend == "postgresql":
                assert conn.connection.driver_connection.autocommit is True
            elif db.backend == "mariadb":
                assert conn.get_isolation_level() == "READ COMMITTED"  # what the server says
        jobs, _, _ = store.finish_and_claim([], 2, uuid.uuid4().hex, False)
        assert len(jobs) == 2
        # Committed by the store itself: another connection sees the claim at once (without the commit
        # MariaDB's connection would keep it in an open transaction, invisible, its rows locked).
        with db.engine.connect() as other:
            states = dict(other.execute(select(app.Job.id, app.Job.state)).all())
        assert sorted(states.values()) == ["pending", "running", "running"]
        assert {states[j.id] for j in jobs} == {"running"}
    finally:
        store.close()


def test_the_hot_connection_goes_back_to_the_pool_at_the_apps_isolation(db: Database) -> None:
    """The app's own checkouts never inherit the worker's READ COMMITTED or autocommit."""
    sql = app.queue.driver(db.engine)
    with db.engine.connect() as conn:
        default = conn.get_isolation_level()
    store = Store(db.engine, app.queue, sql, "hot-test", 60.0, None)
    _enqueue(db, 1)
    assert store.finish_and_claim([], 1, uuid.uuid4().hex, False)[0]
    store.close()
    pool_size = db.engine.pool.checkedin() if hasattr(db.engine.pool, "checkedin") else 1
    for _ in range(max(pool_size, 1)):
        with db.engine.connect() as conn:
            assert conn.get_isolation_level() == default
            if db.backend == "mariadb":
                assert default != "READ COMMITTED"  # the server's default, so the check can fail


SESSION_ID = {"postgresql": "SELECT pg_backend_pid()", "mariadb": "SELECT CONNECTION_ID()"}
KILL = {"postgresql": "SELECT pg_terminate_backend({})", "mariadb": "KILL {}"}


@pytest.mark.parametrize("fixture", ["pg", "mariadb"])
def test_a_pooled_connection_the_server_closed_fails_as_a_lost_connection(fixture: str,
                                                                          request: pytest.FixtureRequest) -> None:
    """The hot connection is taken from the pool and set to its isolation; when the pooled connection was closed by
    the server meanwhile (a restart, a failover), setting the isolation fails with the DBAPI driver's own error,
    which SQLAlchemy does not wrap. The worker must see the ``DBAPIError`` of a lost connection (and try again on a
    new one), not an error it takes for a bug and dies of (an async MariaDB worker did, in the CI's outage cell)."""
    db: Database = request.getfixturevalue(fixture)
    app.queue.create_tables(db.engine)
    engine = create_engine(db.url, pool_size=1)  # one pooled connection: the store's checkout gets the killed one
    sql = app.queue.driver(engine)
    with engine.connect() as conn:
        session = conn.execute(text(SESSION_ID[db.backend])).scalar_one()
        if db.backend == "mariadb":
            assert conn.get_isolation_level() != sql.hot_isolation  # so the store must set it on checkout
    with db.engine.connect() as admin:
        admin.execute(text(KILL[db.backend].format(int(session))))
        admin.commit()
    time.sleep(0.2)  # the server has closed the socket
    store = Store(engine, app.queue, sql, "hot-test", 60.0, None)
    try:
        with pytest.raises(DBAPIError) as caught:
            store.finish_and_claim([], 1, uuid.uuid4().hex, False)
        assert sql.is_disconnect(caught.value), caught.value
        _enqueue(db, 1)  # the next try takes a new connection and works
        assert len(store.finish_and_claim([], 1, uuid.uuid4().hex, False)[0]) == 1
    finally:
        store.close()
        engine.dispose()
