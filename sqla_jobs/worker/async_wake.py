"""``AsyncWake``: the async worker's wake-up, an event its control greenlet awaits and any thread can set."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from sqlalchemy.util import await_only

__all__ = ["AsyncWake"]


class AsyncWake:
    """What the control loop needs of ``threading.Event`` (``set``, ``clear``, ``wait``), on an event loop.

    ``wait`` is called only by the control loop, in its greenlet, and awaits a
    future; ``set`` from the loop's own thread resolves it at once, from any
    other thread (or a signal handler) through ``call_soon_threadsafe``, which
    also wakes a loop sleeping in ``select``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.get_ident()
        self._flag = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        if threading.get_ident() == self._thread:
            self._set()
        else:
            self.set_threadsafe()

    def set_threadsafe(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to wake
            self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        self._flag = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float) -> bool:
        if self._flag:
            return True
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, _resolve, waiter)
        try:
            await_only(waiter)
        finally:
            timer.cancel()
            self._waiter = None
        return self._flag

    def sleep(self, seconds: float) -> None:
        """A pause of the control greenlet that lets the loop's tasks run (``Control.pause``)."""
        await_only(asyncio.sleep(seconds))


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
