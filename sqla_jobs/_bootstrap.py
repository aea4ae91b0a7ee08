"""From a ``module:attr`` and a database URL to a JobQueue and a working engine.

One place for what the CLI, the alembic env helpers (``sqla_jobs.alembic``)
and ``sqla-jobs bench`` all need: import the user's app, turn the URL into the
engine sqla-jobs runs on (the backend's own DBAPI driver, see
``drivers.normalise_url``), and size the pool for a worker. Errors are
ConfigError / ConnectionProblem with one line that says what to change.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

from sqlalchemy import Engine, create_engine, make_url, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

from ._app import JobQueue
from .drivers import driver_class, normalise_url
from .errors import ConfigError, ConnectionProblem, SchemaError

__all__ = ["database_url", "is_async_url", "load_app", "load_worker_app", "make_async_engine", "make_engine",
           "missing_database", "sync_twin", "worker_pool_size"]


def load_app(spec: str | None) -> JobQueue[Any, Any]:
    """Import ``module:attr`` and check it is a JobQueue."""
    if not spec:
        raise ConfigError("no app given: pass --app module:attr (or set SQLA_JOBS_APP) naming your JobQueue")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--app {spec!r} must look like 'package.module:queue'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(_import_problem(spec, module_name, exc)) from None
    except Exception as exc:  # the module itself is broken (SyntaxError, a failing import-time setting, ...)
        raise ConfigError(
            f"--app {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}; "
            f"fix it, then check with: python -c 'import {module_name}'"
        ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--app {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, JobQueue):
        what = f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ConfigError(f"--app {spec!r} is {what}, not a sqla_jobs.JobQueue; name your JobQueue instance")
    return obj


def _import_problem(spec: str, module_name: str, exc: ImportError) -> str:
    """What went wrong importing ``--app``'s module: the module is not there, or it is and an import in it failed."""
    missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
    if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):
        return (f"--app {spec!r}: cannot import {module_name!r} ({exc}): there is no such module here; run from "
                "your project's directory or add it to PYTHONPATH")
    if missing is not None:  # the module was found; something it imports is not installed
        return (f"--app {spec!r}: {module_name!r} was found, but it imports {missing!r}, which is not installed "
                f"for this Python ({sys.executable}); install the package that provides it in this environment "
                f"(e.g. pip install {missing.split('.')[0]}), then check with: python -c 'import {module_name}'")
    return (f"--app {spec!r}: {module_name!r} was found, but an import in it failed (ImportError: {exc}); fix it, "
            f"then check with: python -c 'import {module_name}'")


def load_worker_app(spec: str | None) -> JobQueue[Any, Any]:
    """``load_app`` for a worker: the queue must have handlers, or every job it claims would fail."""
    queue = load_app(spec)
    if not queue.handlers:
        raise ConfigError(
            f"--app {spec!r} has no handlers: a worker would fail every job it claims (unknown kind). Register "
            "them with @queue.handler(\"kind\") in that module, or import the modules that do from it, then start "
            "the worker again"
        )
    return queue


def worker_pool_size(concurrency: int) -> int:
    """Connections a worker with ``concurrency`` threads may hold at once.

    Transactional handlers each hold a connection while they run, plus the
    control loop's and the listener's: the default pool (5 + 10) is too small
    for a high concurrency, and its 30 s checkout timeout would fail long jobs.
    """
    return max(5, concurrency + 2)


def database_url(raw: str | None) -> URL:
    """``raw`` parsed, on the DBAPI driver sqla-jobs ships for its backend; ConfigError if it cannot be used."""
    if not raw:
        raise ConfigError("no database given: pass --url (or set SQLA_JOBS_URL), e.g. sqlite:///jobs.db")
    try:
        url: URL = make_url(raw)
    except (ArgumentError, ValueError):  # ValueError: e.g. a port that is not a number
        shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", raw)  # never echo a password
        raise ConfigError(
            f"--url {shown!r} is not a database URL; expected e.g. postgresql+psycopg://user@host/db "
            "or sqlite:///path/to/jobs.db"
        ) from None
    try:
        return normalise_url(url)
    except ConfigError as exc:
        raise ConfigError(f"--url: {exc}") from None


def missing_database(url: URL) -> str | None:
    """Where ``url``'s database would be if it does not exist yet and connecting would create it."""
    return driver_class(url.get_backend_name()).missing_database(url)


def make_engine(raw: str | None, pool_size: int | None = None, *, create: bool = False) -> Engine:
    """An engine for ``--url`` that answered a ``SELECT 1``.

    ``pool_size``: connections the caller may hold at once (a worker: ``worker_pool_size``).
    ``create``: the command creates the database (``create-tables``); every other one needs
    existing tables, so an SQLite file that does not exist is refused before connecting
    (which would leave an empty file behind, e.g. for a typo in the path).
    An async URL (``sqlite+aiosqlite``, ``postgresql+psycopg_async``: what an async app and its
    worker use) is taken on its backend's sync driver: the same database, for a sync engine.
    """
    url = database_url(raw)
    url = driver_class(url.get_backend_name()).sync_url(url)
    missing = None if create else missing_database(url)
    if missing is not None:
        raise SchemaError(
            f"no database at {missing}: check --url (a typo in the path?), or create the tables with "
            "`sqla-jobs create-tables --url ... --app ...`"
        )
    url, connect_args = driver_class(url.get_backend_name()).connect_args(url)
    try:
        engine = create_engine(url, connect_args=connect_args, **({"pool_size": pool_size} if pool_size else {}))
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigError(f"--url {url.render_as_string()!r}: {exc}") from None
    try:
        with engine.connect() as conn:
            conn.execute(select(1))
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise ConnectionProblem(f"cannot reach the database at {url.render_as_string()}: {first}") from None
    return engine


def is_async_url(raw: str | None) -> bool:
    """Whether ``--url`` names an async DBAPI driver (``postgresql+psycopg_async``, ``sqlite+aiosqlite``)."""
    url = database_url(raw)
    try:
        return bool(url.get_dialect().is_async)
    except (NoSuchModuleError, ImportError):
        return False  # make_engine says what is missing


def sync_twin(raw: str | None) -> str:
    """``--url`` on its backend's sync driver (the async worker's supervisor and metrics use one)."""
    url = database_url(raw)
    return driver_class(url.get_backend_name()).sync_url(url).render_as_string(hide_password=False)


async def make_async_engine(raw: str | None, pool_size: int | None = None) -> Any:
    """An ``AsyncEngine`` for ``--url`` (its backend's async driver if it names a sync one) that answered
    a ``SELECT 1``; the errors of ``make_engine``."""
    try:
        from sqlalchemy.ext.asyncio import create_async_engine
    except ImportError as exc:  # greenlet missing
        raise ConfigError(f"the async worker needs SQLAlchemy's asyncio support: pip install "
                          f"'sqla-jobs[asyncio]' ({exc})") from None
    url = database_url(raw)
    missing = missing_database(url)
    if missing is not None:
        raise SchemaError(f"no database at {missing}: check --url (a typo in the path?), or create the tables "
                          "with `sqla-jobs create-tables --url ... --app ...`")
    driver = driver_class(url.get_backend_name())
    url, connect_args = driver.connect_args(driver.async_url(url))
    try:
        engine = create_async_engine(url, connect_args=connect_args, **({"pool_size": pool_size} if pool_size else {}))
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigError(f"--url {url.render_as_string()!r}: {exc}") from None
    try:
        async with engine.connect() as conn:
            await conn.execute(select(1))
    except DBAPIError as exc:
        await engine.dispose()
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise ConnectionProblem(f"cannot reach the database at {url.render_as_string()}: {first}") from None
    return engine
