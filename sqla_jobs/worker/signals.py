"""SIGTERM and SIGINT in a worker process: the first asks for a graceful stop, a second exits at once.

One ``StopSignals`` per process, installed as early as possible
(``stop_signals()``: the CLI does it before importing the app or connecting),
so a signal during start-up is a stop like any other: it is logged and the
worker stops before its first claim, instead of the process dying of it.
Whoever runs the process (a ``Worker``, the ``--processes`` supervisor, the
relay) ``attach``-es what a stop means for it; a signal that came before is
passed on at once.

The signal handler itself only hands the signal to a thread of its own
(``sqla-jobs-signals``), which logs it and calls what was attached. Python
runs a handler on the main thread between any two bytecodes, also while that
thread holds a lock: a worker's control loop waiting in ``Event.wait`` holds
the event's lock at moments, and a handler that called ``Event.set`` there
waited for that lock forever (a worker hung on SIGTERM in CI). The handler's
one call, ``queue.SimpleQueue.put``, is documented as safe in signal handlers.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["StopSignals", "installed_stop_signals", "release_stop_signals", "stop_signals"]

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
        self._inbox: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._deliverer: threading.Thread | None = None
        # attach() and a delivery never interleave: a signal is passed on exactly once, before or after.
        self._lock = threading.Lock()

    def install(self) -> None:
        self._start_deliverer()
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _start_deliverer(self) -> None:
        self._deliverer = threading.Thread(target=self._deliver, name="sqla-jobs-signals", daemon=True)
        self._deliverer.start()

    def _after_fork(self) -> None:
        """In a forked child the handlers are inherited but no thread is: start a fresh deliverer."""
        if self._deliverer is not None:
            self._inbox, self._lock = queue.SimpleQueue(), threading.Lock()  # the parent may have held the lock
            self._start_deliverer()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._deliverer is not None:
            self._inbox.put(None)  # no handler of ours is left to put a signal behind it
            self._deliverer.join()
            self._deliverer = None

    def attach(self, who: str, on_stop: Callable[[], None], on_again: Callable[[], None] | None = None) -> None:
        """From now on a first signal calls ``on_stop``, a later one ``on_again`` (default: exit at once)."""
        with self._lock:
            self._who, self._on_stop, self._on_again = who, on_stop, on_again
            if self.received:
                on_stop()

    def _handle(self, signum: int, frame: Any) -> None:
        self._inbox.put(signum)  # nothing else here: see the module docstring

    def _deliver(self) -> None:
        # The main thread alone should take the signals (its blocking calls are the ones they interrupt).
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        while (signum := self._inbox.get()) is not None:
            with self._lock:
                self._pass_on(signal.Signals(signum).name)

    def _pass_on(self, name: str) -> None:
        self.received += 1
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


def _after_fork_in_child() -> None:
    if _installed is not None:
        _installed._after_fork()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def installed_stop_signals() -> StopSignals | None:
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
