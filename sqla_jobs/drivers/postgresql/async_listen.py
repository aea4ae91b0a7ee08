"""PostgreSQL LISTEN for the async worker: a task on its event loop that wakes it when a job is enqueued.

The threaded worker's listener (``pg_listen``) is a thread; under the async
worker a thread's notification would reach the control loop only through
``call_soon_threadsafe`` (a pipe write, a loop wake-up, then the callback), a
tenth of a millisecond on every pickup. This one is a task on the loop itself:
it holds one psycopg ``AsyncConnection`` taken out of the worker's
``AsyncEngine`` pool (so it is hardened like the worker's others, see
``pg_keepalive``), in autocommit mode, listening on the jobs table's channel,
and calls ``wake`` for each notification in the loop's own thread.

It reconnects as the thread does: the first reconnect is immediate (a checkout
never hands out a connection the server closed), later ones at most half a
second apart, so LISTEN is back within half a second of the server; after each
reconnect it wakes the worker once, since notifications sent meanwhile are
lost. A long outage logs once a minute, not once a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["PgAsyncListener"]

log = logging.getLogger("sqla_jobs.worker")


class PgAsyncListener:
    """``start()`` a task on the running loop that calls ``wake`` on every notification until ``await stop()``."""

    def __init__(self, engine: AsyncEngine, channel: str, wake: Callable[[], None], worker_name: str) -> None:
        self.engine = engine
        self.channel = channel
        self.wake = wake
        self.worker_name = worker_name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """From the loop's thread (the worker's control greenlet runs there)."""
        self._task = asyncio.get_running_loop().create_task(self._main(), name="sqla-jobs-listen")

    async def stop(self) -> None:
        """Cancel the task and wait until its connection is closed."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _main(self) -> None:
        failures = 0
        while True:
            conn: Any = None
            try:
                raw = await self.engine.raw_connection()
                conn = raw.driver_connection  # before detach(): after it the pool entry no longer knows it
                raw.detach()  # a long-lived LISTEN connection does not belong in the pool
                await conn.set_autocommit(True)
                await conn.execute(f'LISTEN "{self.channel}"')
                if failures:
                    log.info("worker %s: LISTEN connection is back", self.worker_name)
                failures = 0
                self.wake()  # notifications sent while we were away are lost: look now
                await self._until_lost(conn.pgconn)
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 60 == 0:  # a long outage: not one line per try
                    log.info("worker %s: LISTEN connection failed (%s); polling until it is back",
                             self.worker_name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                if failures > 1:
                    await asyncio.sleep(min(0.5, 0.125 * 2 ** min(failures - 2, 2)))
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()

    async def _until_lost(self, pgconn: Any) -> None:
        """Wake on every notification until the connection fails (raises its error), or until cancelled.

        libpq's own calls (psycopg's ``pq`` layer) from a reader callback, not psycopg's
        ``notifies()`` generator: the notification is read and the worker woken in the same turn of
        the loop in which the socket became readable (the generator took one turn more).
        """
        from psycopg import pq  # here: processes on other databases never load psycopg

        loop = asyncio.get_running_loop()
        lost: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                pgconn.consume_input()  # raises when the server closed the connection (or the network died)
                if pgconn.status != pq.ConnStatus.OK:
                    raise ConnectionError("the LISTEN connection was closed")
            except Exception as exc:
                if not lost.done():
                    lost.set_exception(exc)
                return
            notified = False
            while pgconn.notifies() is not None:
                notified = True
            if notified:
                self.wake()

        fd = pgconn.socket
        loop.add_reader(fd, readable)
        try:
            await lost
        finally:
            loop.remove_reader(fd)
