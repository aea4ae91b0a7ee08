"""Telling an outage of the queue's database from a handler's own failure.

An attempt whose handler failed because the queue's database went away (a
restart, a failover, a killed connection) is not the job's fault, so it is
not charged (docs/guarantees.md, "Database outages"). The rule: the attempt
counts as interrupted by an outage when, on the handler's thread and during
that attempt, SQLAlchemy saw a connection to the queue database drop (its
dialect calls the error a disconnect), fail to open, or refuse a write because
the server takes none (a standby, a server switched to read-only). "The queue database"
is any engine with the same backend, host, port and database name as the
worker's engine, so a handler's own engine on that database counts, and any
other database the handler talks to does not: its errors are the handler's.

SQLAlchemy reports every DBAPI error to ``handle_error`` listeners, with the
engine and whether the connection is gone; one listener on ``Engine`` notes
the database of each drop in a set held by a context variable, but only while
a worker is watching (``watch()``), so it costs nothing elsewhere. A context
variable, not a thread-local: each handler thread has its own context, and so
does each handler task of the async worker (all on one thread), and SQLAlchemy
runs an async engine's statements in the context of the task that awaits them.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import URL, ExceptionContext
from sqlalchemy.exc import DBAPIError

from ..drivers import driver_class_of
from ..errors import ConfigError

__all__ = ["database_key", "watch"]

DatabaseKey = tuple[Any, ...]

_seen: ContextVar[set[DatabaseKey] | None] = ContextVar("sqla_jobs_watched_databases", default=None)


def database_key(url: URL) -> DatabaseKey:
    """One database, whatever the driver, credentials or options (``search_path``) of the URL."""
    return (url.get_backend_name(), url.host, url.port, url.database)


def _note(ctx: ExceptionContext) -> None:
    watching = _seen.get()
    if watching is None or ctx.engine is None:
        return
    # No connection at all means it could not be opened (refused, timed out, server starting up).
    unreachable = ctx.connection is None and isinstance(ctx.sqlalchemy_exception, DBAPIError)
    # A server that takes no writes (a standby, switched to read-only) fails the handler as an outage would.
    if ctx.is_disconnect or unreachable or _read_only(ctx):
        watching.add(database_key(ctx.engine.url))


def _read_only(ctx: ExceptionContext) -> bool:
    try:
        driver = driver_class_of(ctx.dialect)
    except ConfigError:  # a database sqla-jobs has no driver for: not the queue's
        return False
    return driver.is_read_only(ctx.sqlalchemy_exception)


event.listen(Engine, "handle_error", _note)


class watch:  # noqa: N801 -- used as a function: ``with watch() as dropped``
    """Collect, for the calling thread (or task), the databases whose connections dropped meanwhile.

    A class, not a ``@contextmanager`` generator: every run enters one, and the generator's
    machinery cost a handler thread more than the rest of a no-op job's run."""

    __slots__ = ("_token",)
    _token: Token[set[DatabaseKey] | None]

    def __enter__(self) -> set[DatabaseKey]:
        found: set[DatabaseKey] = set()
        self._token = _seen.set(found)
        return found

    def __exit__(self, *exc: object) -> None:
        _seen.reset(self._token)
