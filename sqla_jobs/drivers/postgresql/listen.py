"""PostgreSQL LISTEN: a thread that wakes an idle worker when a job is enqueued.

The jobs table's trigger sends a NOTIFY on the table's channel when an
enqueuing transaction commits (``pg_notify.notify_trigger_ddl``). This thread
holds one connection outside the pool, in autocommit mode, listening on that
channel, and calls ``wake`` for each notification. It reconnects on errors:
the first reconnect is immediate (a checkout never hands out a connection the
server closed, see ``pg_keepalive``), later ones at most half a second apart,
so LISTEN is back within half a second of the server; after each reconnect it
wakes the worker once, since notifications sent meanwhile are lost.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from sqlalchemy import Engine

__all__ = ["PgListener"]

log = logging.getLogger("sqla_jobs.worker")


class PgListener:
    """``start()`` a daemon thread that calls ``wake`` on every notification until ``stop()``."""

    def __init__(self, engine: Engine, channel: str, wake: Callable[[], None], worker_name: str) -> None:
        self.engine = engine
        self.channel = channel
        self.wake = wake
        self.worker_name = worker_name
        self._closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._main, daemon=True, name="sqla-jobs-listen").start()

    def stop(self) -> None:
        """The thread ends within a second (its wait for notifications times out)."""
        self._closed.set()

    def _main(self) -> None:
        failures = 0
        while not self._closed.is_set():
            conn = None
            try:
                raw = self.engine.raw_connection()
                conn = raw.driver_connection  # before detach(): after it the pool entry no longer knows it
                raw.detach()  # a long-lived LISTEN connection does not belong in the pool
                conn.autocommit = True  # type: ignore[union-attr]
                conn.execute(f'LISTEN "{self.channel}"')  # type: ignore[union-attr]
                if failures:
                    log.info("worker %s: LISTEN connection is back", self.worker_name)
                failures = 0
                self.wake()  # notifications sent while we were away are lost: look now
                while not self._closed.is_set():
                    for _ in conn.notifies(timeout=1.0):  # type: ignore[union-attr]
                        self.wake()
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 60 == 0:  # a long outage: not one line per second
                    log.info("worker %s: LISTEN connection failed (%s); polling until it is back",
                             self.worker_name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                if failures > 1:
                    self._closed.wait(min(0.5, 0.125 * 2 ** min(failures - 2, 2)))
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
