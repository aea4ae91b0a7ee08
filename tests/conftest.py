"""Test harness: every test that takes ``db`` runs on a SQLite file, on PostgreSQL and on MariaDB.

PostgreSQL tests each get a fresh schema (dropped afterwards), selected through
the URL's ``search_path``, so worker subprocesses given ``db.url`` see the
same tables; MariaDB tests each get a fresh database (``t_<hex>``). Override
the servers with ``SQLA_JOBS_TEST_PG_URL`` and ``SQLA_JOBS_TEST_MARIADB_URL``.
When a server is unreachable its tests skip, except with ``CI=true``, where the
run fails: CI must never pass by skipping a backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url, text
from sqlalchemy.engine import URL

from tests import app, forkserver
from tests.suite_database import database_name, ensure_database

ROOT = Path(__file__).resolve().parent.parent

# The suite starts about two thousand Python processes (workers, CLI commands, alembic). Where the machine
# sets PYTHONDONTWRITEBYTECODE, each of them compiled sqla_jobs and the test apps from source again: 0.13 s of
# its 0.55 s start. They write their bytecode instead, into the __pycache__ folders git ignores (Python
# writes each file atomically, so concurrent test processes share them safely).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
PG_URL = os.environ.get("SQLA_JOBS_TEST_PG_URL", f"postgresql+psycopg://postgres@127.0.0.1:5432/{database_name()}")
MARIADB_URL = os.environ.get("SQLA_JOBS_TEST_MARIADB_URL", "mariadb+pymysql://root@127.0.0.1:3306/test?charset=utf8mb4")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

#: Every backend the suite runs on, by SQLAlchemy dialect name: the ``db`` fixture and the driver
#: conformance suite (tests/drivers/) run once per name. A new backend adds its name here and a
#: branch to ``make_database``; tests/drivers/ checks that every registered driver is listed.
BACKENDS = ("sqlite", "postgresql", "mariadb")
#: The driver conformance suite runs on these too: PostgreSQL with a partitioned jobs table
#: (``create-tables --partitioned``, sqla_jobs/drivers/postgresql/partitions.py), backend "postgresql".
MODES = ("postgresql-partitioned",)


#: Four test processes each start worker subprocesses with pools of their own: the parallel phase holds up
#: to about 150 connections at once. A server allowing fewer fails tests at random ("too many clients").
CONNECTIONS_NEEDED = 300


def _available(server: str) -> str | None:
    try:
        engine = create_engine(server)
        with engine.connect() as conn:
            limit = int(conn.execute(text("select @@max_connections" if engine.dialect.name in ("mysql", "mariadb")
                                          else "show max_connections")).scalar_one())
        engine.dispose()
    except Exception as exc:
        return str(exc).splitlines()[0]
    if "PYTEST_XDIST_WORKER" in os.environ and limit < CONNECTIONS_NEEDED:
        return (f"the server allows {limit} connections and the parallel suite needs {CONNECTIONS_NEEDED}: raise "
                "max_connections (PostgreSQL: ALTER SYSTEM SET max_connections = 300, then restart; MariaDB: "
                "SET GLOBAL max_connections = 300), as .ci/run does, or run the suite without -n")
    return None


def _pg_available() -> str | None:
    global _PG_CREATED
    if "SQLA_JOBS_TEST_PG_URL" not in os.environ:  # a URL given by hand is used as it is
        try:
            _PG_CREATED = ensure_database(PG_URL)
        except Exception as exc:
            return str(exc).splitlines()[0]
    return _available(PG_URL)


_PG_CREATED: str | None = None
_PG_PROBLEM = _pg_available()
_MARIADB_PROBLEM = _available(MARIADB_URL)


def pytest_report_header() -> list[str]:
    # Say loudly which database the suite writes to, and whether it just created it.
    return [f"sqla-jobs tests: PostgreSQL at {make_url(PG_URL).render_as_string()}", *filter(None, [_PG_CREATED])]


@dataclass
class Database:
    backend: str  # a name in BACKENDS
    url: str  # with the password, for subprocesses
    engine: Engine
    schema: str | None = None
    partitioned: bool = False  # the jobs table is to be created partitioned (MODES)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SQLA_JOBS_URL": self.url, "PYTHONPATH": str(ROOT), **extra}


def require_postgres() -> None:
    if _PG_PROBLEM:
        if IN_CI:
            pytest.fail(f"PostgreSQL is required in CI but unreachable at {PG_URL}: {_PG_PROBLEM}")
        pytest.skip(f"PostgreSQL unreachable at {PG_URL}: {_PG_PROBLEM}")


def require_mariadb() -> None:
    if _MARIADB_PROBLEM:
        if IN_CI:
            pytest.fail(f"MariaDB is required in CI but unreachable at {MARIADB_URL}: {_MARIADB_PROBLEM}")
        pytest.skip(f"MariaDB unreachable at {MARIADB_URL}: {_MARIADB_PROBLEM}")


def server_url(backend: str, sqlite_file: Path) -> str:
    """The URL a test hands a command that makes its own scratch tables (``bench``): the shared server's, or
    a SQLite file; requires the server (fails in CI when it is down)."""
    if backend == "postgresql":
        require_postgres()
        return PG_URL
    if backend == "mariadb":
        require_mariadb()
        return MARIADB_URL
    return f"sqlite:///{sqlite_file}"


def _make_mariadb() -> Iterator[Database]:
    """A fresh database per test (MariaDB's schemas are databases), dropped afterwards."""
    require_mariadb()
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(MARIADB_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    rendered = make_url(MARIADB_URL).set(database=name).render_as_string(hide_password=False)
    engine = create_engine(rendered)
    try:
        yield Database("mariadb", rendered, engine, name)
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


def make_database(backend: str, tmp_path: Path) -> Iterator[Database]:
    if backend == "mariadb":
        yield from _make_mariadb()
        return
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobs.db'}"
        engine = create_engine(url)
        yield Database("sqlite", url, engine)
        engine.dispose()
        return
    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    base: URL = make_url(PG_URL)
    url = base.update_query_dict({"options": f"-csearch_path={schema}"})
    rendered = url.render_as_string(hide_password=False)
    engine = create_engine(rendered)
    try:
        yield Database("postgresql", rendered, engine, schema, partitioned=backend == "postgresql-partitioned")
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    """An empty database with the test app's tables, on each backend."""
    for database in make_database(request.param, tmp_path):
        monkeypatch.setenv("SQLA_JOBS_URL", database.url)
        app._engine = None  # the handlers' engine follows SQLA_JOBS_URL
        app.queue.create_tables(database.engine)
        app.Base.metadata.create_all(database.engine)
        yield database
        if app._engine is not None:
            app._engine.dispose()
            app._engine = None


@pytest.fixture
def pg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    """PostgreSQL only, for the features only it has."""
    for database in make_database("postgresql", tmp_path):
        monkeypatch.setenv("SQLA_JOBS_URL", database.url)
        app._engine = None
        app.Base.metadata.create_all(database.engine)
        yield database
        if app._engine is not None:
            app._engine.dispose()
            app._engine = None


@pytest.fixture
def mariadb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    """MariaDB only, for what only its tools can do (``KILL <id>``)."""
    for database in make_database("mariadb", tmp_path):
        monkeypatch.setenv("SQLA_JOBS_URL", database.url)
        app._engine = None
        app.Base.metadata.create_all(database.engine)
        yield database
        if app._engine is not None:
            app._engine.dispose()
            app._engine = None


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``sqla-jobs ARGS`` in a subprocess, as a user would."""
    return forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        **kw,
    )
