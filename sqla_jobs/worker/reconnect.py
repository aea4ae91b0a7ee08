"""When the worker tries the database again after an error.

A lost connection is no reason to wait: the next try runs at once while the
server answers, and at most half a second apart while it does not. Other
errors back off exponentially. Which errors are a lost connection is the
driver's call (``Driver.is_disconnect``).
"""

from __future__ import annotations

from sqlalchemy import Engine

from ..drivers import Driver

__all__ = ["READ_ONLY_PAUSE", "database_answers", "retry_pause"]

#: Seconds between tries while the database takes no writes.
READ_ONLY_PAUSE = 1.0


def database_answers(engine: Engine) -> bool:
    """Can a live connection be had (from the pool, checked as above, or a new one)?"""
    try:
        with engine.connect():
            return True
    except Exception:  # refused, starting up, timed out, pool exhausted: not now
        return False


def retry_pause(driver: Driver, engine: Engine, exc: BaseException, failures: int) -> float:
    """Seconds the worker waits before its next try, after ``failures`` database errors in a row.

    A lost connection is no reason to wait. Every pooled connection opened
    before it may be stale too (a server restart or a failover cut them all),
    but a checkout never hands out one the server closed (the driver's ``harden``),
    so if a connection can be had, the next try runs at once. Only while the
    server does not answer does the worker wait, at most half a second between
    tries, so it is back within half a second of the server (each try is one
    refused connect: cheap for both). A server that takes no writes is asked
    again every second, on new connections. Other errors (a deadlock, a full pool)
    back off exponentially, and so does a disconnect that keeps coming back
    although the server answers.
    """
    if driver.is_read_only(exc):
        # A standby, or a server switched to read-only: during a failover the writable server may be another
        # host of the URL (libpq's target_session_attrs=read-write picks it), so the pool's connections are
        # let go and the next try opens new ones.
        engine.dispose(close=False)
        return READ_ONLY_PAUSE
    if not driver.is_disconnect(exc):
        return min(30.0, 0.25 * 2 ** min(failures, 7))
    if failures <= 3 and database_answers(engine):
        return 0.0
    return min(0.5, 0.125 * 2 ** min(failures, 2))
