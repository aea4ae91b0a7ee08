"""The suite's own PostgreSQL database (``sqla_jobs_test``), so it never writes to a shared one such as ``test``."""

from __future__ import annotations

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.exc import DBAPIError

#: Created on first use by ``ensure_database`` unless ``SQLA_JOBS_TEST_PG_URL`` names another database.
TEST_DATABASE = "sqla_jobs_test"


def ensure_database(url: str) -> str | None:
    """Create ``url``'s database from the server's ``postgres`` database if it is missing.

    Returns a line saying what was created (shown in pytest's header), or None.
    Nothing is ever dropped: each test works in a schema of its own inside it.
    """
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if conn.scalar(text("select 1 from pg_database where datname = :n"), {"n": target.database}):
                return None
            try:
                conn.execute(text(f'CREATE DATABASE "{target.database}"'))
            except DBAPIError:  # another test run created it a moment ago
                if not conn.scalar(text("select 1 from pg_database where datname = :n"), {"n": target.database}):
                    raise
                return None
    finally:
        admin.dispose()
    return f"sqla-jobs tests: created PostgreSQL database {target.database!r} on {target.host}:{target.port}"
