"""How a worker's PostgreSQL connections notice a dead network instead of hanging.

A worker waits on its database socket for every claim, heartbeat and finish.
If the network between it and PostgreSQL dies silently (a host vanishes, a
firewall drops the flow, no RST ever arrives), a plain connection waits on
that socket for hours: the worker neither works nor exits. So on PostgreSQL
(psycopg) the worker gives every connection it opens these libpq settings,
unless the database URL already sets them::

    connect_timeout      10      seconds to establish a connection
    keepalives           1       TCP keepalive probes on idle connections
    keepalives_idle      10      seconds idle before the first probe
    keepalives_interval  5       seconds between probes
    keepalives_count     3       unanswered probes before the socket is dead
    tcp_user_timeout     30000   ms that sent data may stay unacknowledged
    application_name     sqla-jobs worker <worker name>

The server gets the same keepalive settings for its side of the socket
(``tcp_keepalives_idle``/``_interval``/``_count``, ``tcp_user_timeout``, one
``SET`` per new connection: not startup options, which PgBouncer rejects), so
a worker that vanishes in the middle
of a transaction has its session ended and its row locks released within
about 30 seconds, and the reaper can take its jobs over.

With these a dead peer is detected within about 30 seconds; the query fails
with an OperationalError, the control loop backs off and reconnects, and
whatever the worker had claimed meanwhile is covered by its lease (another
worker takes it over; the stale worker's late writes are fenced off).
``application_name`` shows the worker in ``pg_stat_activity``. Override any
of them in the URL, e.g. ``...?keepalives_idle=30&application_name=billing``.

A connection the server closed (``pg_terminate_backend``, a restart, a
failover, an idle-connection killer) is different: the server says so on the
socket, but a connection idle in the pool does not read it, and the next
statement on it fails. So every pool checkout first looks whether the socket
has anything to read (one ``poll()`` system call, no round trip: an idle
connection in a healthy session has nothing to say). Only if it has, a ping
decides; a dead connection makes the pool discard every connection opened
before it (SQLAlchemy's pool invalidation), so one cut costs one reconnect
per connection, not one failed statement each. ``sqla_jobs.worker.reconnect``
tells the worker's control loop when to try again: at once after a disconnect
while the server answers, with backoff after other errors.
"""

from __future__ import annotations

import select
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import DBAPIError, InvalidatePoolError

__all__ = ["DEFAULTS", "SERVER_SIDE", "check_alive", "harden", "is_disconnect"]

DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}

#: The server's side of the same socket (PostgreSQL settings, per session).
SERVER_SIDE: dict[str, int] = {
    "tcp_keepalives_idle": 10,
    "tcp_keepalives_interval": 5,
    "tcp_keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def harden(engine: Engine, worker_name: str) -> None:
    """Give ``engine``'s new psycopg connections the settings above (the PostgreSQL driver calls it)."""
    if engine.dialect.driver != "psycopg":
        return
    settings: dict[str, Any] = {**DEFAULTS, "application_name": f"sqla-jobs worker {worker_name}"[:63]}

    # The URL's query becomes the DSN, not keyword arguments: read both so the user's values win.
    given = set(engine.url.query)

    def add_settings(dialect: Any, conn_rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        for key, value in settings.items():
            if key not in given:
                cparams.setdefault(key, value)

    def set_server_side(dbapi_connection: Any, connection_record: Any) -> None:
        wanted = dict(SERVER_SIDE)
        if dbapi_connection.info.server_version < 120000:  # tcp_user_timeout came in PostgreSQL 12
            wanted.pop("tcp_user_timeout")
        with dbapi_connection.cursor() as cursor:
            cursor.execute("; ".join(f"SET {key} = {value}" for key, value in wanted.items()))
        dbapi_connection.commit()  # psycopg opened a transaction for the SETs

    if not getattr(engine, "_sqla_jobs_hardened", False):
        event.listen(engine, "do_connect", add_settings)
        event.listen(engine, "connect", set_server_side)
        event.listen(engine, "checkout", check_alive)
        engine._sqla_jobs_hardened = True  # type: ignore[attr-defined]
        # Idle pooled connections were opened without these settings: open fresh ones.
        engine.pool.dispose()


#: SQLSTATEs of a server that ended the session or does not take connections now
#: (admin_shutdown, crash_shutdown, cannot_connect_now); class 08 is "connection exception".
_GONE = ("57P01", "57P02", "57P03")


def is_disconnect(exc: BaseException) -> bool:
    """Whether ``exc`` means the connection (or the server) is gone, not that a statement failed.

    SQLAlchemy marks the disconnects it sees (``connection_invalidated``); the
    worker's hot path runs statements on the driver's cursor, which SQLAlchemy
    does not see, so psycopg's errors are classified here too: no SQLSTATE (the
    client lost the socket or could not connect), class 08, or a shutdown.
    A deadlock or a cancelled query is not a disconnect.
    """
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    if not type(orig).__module__.startswith("psycopg"):
        return False
    state = getattr(orig, "sqlstate", None)
    if state is not None:
        return state.startswith("08") or state in _GONE
    # psycopg is optional (SQLite users): compare class names, not classes.
    return any(cls.__name__ in ("OperationalError", "InterfaceError") for cls in type(orig).__mro__)


def _has_input(dbapi_connection: Any) -> bool:
    """Whether the server sent something on this idle connection (a farewell, or the socket's EOF)."""
    if dbapi_connection.closed or getattr(dbapi_connection, "broken", False):
        return True
    poller = select.poll()
    # Under an AsyncEngine the pool holds SQLAlchemy's adapter: the socket is its psycopg connection's.
    raw = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    poller.register(raw.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def check_alive(dbapi_connection: Any, connection_record: Any, connection_proxy: Any) -> None:
    """Pool checkout: a connection the server closed is replaced, and so is every older one.

    No round trip in the normal case; a ping only when the socket has
    something to read (then it is most likely the server's goodbye).
    """
    if not _has_input(dbapi_connection):
        return
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        dbapi_connection.rollback()  # the ping opened a transaction: leave the connection idle
    except Exception as exc:
        raise InvalidatePoolError(f"connection closed by the server: {exc}") from exc
