"""The suite writes to a database of its own (``sqla_jobs_test``), never to a shared one such as ``test``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from sqlalchemy import Connection, create_engine, make_url, text

from tests.conftest import PG_URL, ROOT, require_postgres
from tests.suite_database import ensure_database


def test_the_default_url_names_the_suites_own_database() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("SQLA_JOBS_TEST_PG_URL", "PYTEST_XDIST_WORKER")}
    env["PYTHONPATH"] = str(ROOT)
    code = "from tests.conftest import PG_URL; print(PG_URL)"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert make_url(result.stdout.strip()).database == "sqla_jobs_test"
    env["PYTEST_XDIST_WORKER"] = "gw3"  # a pytest-xdist test worker: a database of its own
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert make_url(result.stdout.strip()).database == "sqla_jobs_test_gw3"


@contextmanager
def probe_database() -> Iterator[tuple[str, str, Connection]]:
    """(name, URL, an autocommit connection to the server's ``postgres``) of a database that does not
    exist yet; dropped afterwards if a test made it."""
    require_postgres()
    name = f"sqla_jobs_probe_{uuid.uuid4().hex[:8]}"
    admin = create_engine(make_url(PG_URL).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            try:
                yield name, make_url(PG_URL).set(database=name).render_as_string(hide_password=False), conn
            finally:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        admin.dispose()


def test_a_missing_database_is_created_once_and_said_so() -> None:
    with probe_database() as (name, url, conn):
        note = ensure_database(url)
        assert note is not None and repr(name) in note and "created" in note
        assert conn.scalar(text("select 1 from pg_database where datname = :n"), {"n": name}) == 1
        assert ensure_database(url) is None  # there already: nothing created, nothing said


def test_test_workers_starting_together_create_a_database_once() -> None:
    """pytest -n 4 starts four test workers at once; a fifth run's worker may want the same database."""
    with probe_database() as (_, url, _conn), ThreadPoolExecutor(6) as pool:
        notes = list(pool.map(lambda _: ensure_database(url), range(6)))
    assert sum(note is not None for note in notes) == 1, notes
