"""SIGTERM and SIGINT in a worker process: the first asks for a graceful stop, a second exits at once.

One ``StopSignals`` per process, installed as early as possible
(``stop_signals()``: the CLI does it before importing the app or connecting),
so a signal during start-up is a stop like any other: it is logged and the
worker stops before its first claim, instead of the process dying of it.
Whoever runs the process (a ``Worker``, the ``--processes`` supervisor)
``attach``-es what a stop means for it; a signal that came before is passed
on at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["StopSignals", "current", "release_stop_signals", "stop_signals"]

log = logging.getLogger("sqla_jobs.worker")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _exit_now(who: str) -> None:
    log.warning("%s: second signal, exiting now; leases cover the running jobs", who)
    os._exit(1)


class StopSignals:
    def __init__(self) -> None:
        self.received = 0
        self._who = "worker"
        self._on_stop: Callable[[], None] | None = None
        self._on_again: Callable[[], None] | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def attach(self, who: str, on_stop: Callable[[], None], on_again: Callable[[], None] | None = None) -> None:
        """From now on a first signal calls ``on_stop``, a later one ``on_again`` (default: exit at once)."""
        self._who, self._on_stop, self._on_again = who, on_stop, on_again
        if self.received:
            on_stop()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received > 1:
            if self._on_again is None:
                _exit_now(self._who)
            else:
                log.warning("%s: %s received again, stopping at once", self._who, name)
                self._on_again()
            return
        if self._on_stop is None:
            log.info("%s received during start-up: stopping before the first job", name)
            return
        log.info("%s: %s received, shutting down gracefully (signal again to exit at once)", self._who, name)
        self._on_stop()


_installed: StopSignals | None = None


def current() -> StopSignals | None:
    """The StopSignals installed in this process, if any."""
    return _installed


def stop_signals() -> StopSignals | None:
    """This process's StopSignals, installed on first use; None off the main thread (Python allows
    signal handlers only there: a worker run on another thread is stopped with ``Worker.stop``)."""
    global _installed
    if _installed is None:
        if threading.current_thread() is not threading.main_thread():
            return None
        _installed = StopSignals()
        _installed.install()
    return _installed


def release_stop_signals() -> None:
    """Restore the handlers that were there before ``stop_signals()`` (a Python caller's own)."""
    global _installed
    if _installed is not None:
        _installed.restore()
        _installed = None
