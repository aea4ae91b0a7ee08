"""The suite's own PostgreSQL databases, so it never writes to a shared one such as ``test``.

A serial run uses ``sqla_jobs_test``. Under pytest-xdist (``pytest -n 4``) each test worker
``gw<N>`` gets ``sqla_jobs_test_gw<N>``: the workers' tests then never see one another in
``pg_stat_activity``, in a LISTEN channel or in a database-wide advisory lock.
"""

from __future__ import annotations

import os

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import DBAPIError

#: Created on first use by ``ensure_database`` unless ``SQLA_JOBS_TEST_PG_URL`` names another database.
TEST_DATABASE = "sqla_jobs_test"
#: Any fixed number: the advisory lock that makes concurrent test runs create their databases one at a time.
_CREATE_LOCK = 7_346_201


def database_name() -> str:
    """``sqla_jobs_test``, or ``sqla_jobs_test_gw<N>`` inside pytest-xdist's test worker ``gw<N>``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return f"{TEST_DATABASE}_{worker}" if worker else TEST_DATABASE


def ensure_database(url: str) -> str | None:
    """Create ``url``'s database from the server's ``postgres`` database if it is missing.

    Returns a line saying what was created (shown in pytest's header), or None.
    Nothing is ever dropped: each test works in a schema of its own inside it.
    """
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    exists = text("select 1 from pg_database where datname = :n")
    try:
        with admin.connect() as conn:
            if conn.scalar(exists, {"n": target.database}):
                return None
            # Two CREATE DATABASE at once fail ("source database template1 is being accessed by other
            # users"): the test workers starting together take turns.
            conn.execute(text("select pg_advisory_lock(:k)"), {"k": _CREATE_LOCK})
            try:
                if conn.scalar(exists, {"n": target.database}):
                    return None
                try:
                    conn.execute(text(f'CREATE DATABASE "{target.database}"'))
                except DBAPIError:  # another run, on a server without the lock's key free, made it meanwhile
                    if not conn.scalar(exists, {"n": target.database}):
                        raise
                    return None
            finally:
                conn.execute(text("select pg_advisory_unlock(:k)"), {"k": _CREATE_LOCK})
    finally:
        admin.dispose()
    return f"sqla-jobs tests: created PostgreSQL database {target.database!r} on {target.host}:{target.port}"
