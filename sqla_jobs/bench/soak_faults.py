"""``sqla-jobs bench --soak DURATION --faults SEED``: the soak with a fault every 30 to 60 seconds
(``--fault-every MIN-MAX``).

::

    sqla-jobs bench --url postgresql+psycopg://user@host/db --soak 20m --rate 2000 --processes 2 \\
        --faults 7 --out soak-faults

The faults are drawn with ``random.Random(SEED)``, so the same seed gives the same faults at the same
moments (the jobs they hit depend on timing). Each one is what production does to a worker fleet:

``kill``
    SIGKILL one worker process: a crash or an OOM kill. Its jobs run again once their lease expires.
``term``
    SIGTERM one worker process: a deploy's graceful stop. It finishes or gives back what it runs.
``stall``
    SIGSTOP one worker process for one and a half leases, then SIGCONT: a host frozen past its lease
    (a VM migration, swapping). Other workers take its jobs over; what it finishes late is discarded.
``cut`` (PostgreSQL)
    ``pg_terminate_backend`` on every connection the worker processes hold (they name them): a proxy
    or a failover dropping them. The workers reconnect; the attempts cut short are refunded.

A worker process that was killed or stopped is replaced at once, so the fleet keeps its size
(``--processes``, two by default: two hosts' worth of workers on one machine).

Under faults the report counts the jobs that finished from the database (the finished rows left plus
those the pruner deleted, each deleted once), not from the handler starts the workers ship: a killed
worker takes the starts it had not shipped yet with it. Every enqueued job must have finished, with
nothing left pending or dead-lettered. Handler starts seen twice are reruns after a fault
(at-least-once delivery, the crash's price), reported as ``reruns``; two runs of one job at once are
what leases, fencing and self-fencing prevent (``docs/guarantees.md``). Worker leases are 10 s
(heartbeat 2 s) under faults, so a crashed worker's jobs come back within seconds.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from .run import queue

__all__ = ["FAULT_HEARTBEAT", "FAULT_LEASE", "Fault", "Fleet", "inject_faults"]

#: Worker lease and heartbeat under faults: short, so a crash costs seconds, not the default half minute.
FAULT_LEASE, FAULT_HEARTBEAT = 10.0, 2.0


@dataclasses.dataclass
class Fault:
    at: float  # seconds since the producer started
    kind: str
    detail: str


class Fleet:
    """The soak's worker processes; ``replace`` starts a new one in a dead one's place."""

    def __init__(self, start: Callable[[], Any]) -> None:
        self._start = start
        self.procs: list[Any] = []
        self.lock = threading.Lock()

    def grow(self, n: int) -> None:
        for _ in range(n):
            self.procs.append(self._start())

    def replace(self, proc: Any) -> None:
        with self.lock:
            self.procs[self.procs.index(proc)] = self._start()

    def pick(self, rng: random.Random) -> Any:
        with self.lock:
            return rng.choice(self.procs)


def inject_faults(seed: int, every: tuple[float, float], fleet: Fleet, engine: Engine, origin: float,
                  faults: list[Fault], stop: threading.Event) -> None:
    """A fault every ``every`` seconds (drawn in that range) until ``stop``; each is appended to ``faults``."""
    rng = random.Random(seed)
    kinds = ["kill", "term", "stall"] + (["cut"] if queue.driver(engine).bench_cuts_connections else [])
    while not stop.wait(rng.uniform(*every)):
        kind = rng.choice(kinds)
        at = time.time() - origin
        if kind == "cut":
            with engine.connect() as conn:
                faults.append(Fault(at, kind, f"{queue.driver(conn).bench_cut_connections(conn)} worker "
                                              "connections terminated"))
            continue
        proc = fleet.pick(rng)
        if kind == "stall":
            os.kill(proc.pid, signal.SIGSTOP)
            faults.append(Fault(at, kind, f"worker {proc.pid} stopped for {1.5 * FAULT_LEASE:g}s"))
            stop.wait(1.5 * FAULT_LEASE)
            os.kill(proc.pid, signal.SIGCONT)
            continue
        os.kill(proc.pid, signal.SIGKILL if kind == "kill" else signal.SIGTERM)
        faults.append(Fault(at, kind, f"worker {proc.pid}"))
        proc.join(60)
        if proc.is_alive():  # a graceful stop longer than a minute: the soak fails on it below
            faults.append(Fault(time.time() - origin, "stuck", f"worker {proc.pid} did not exit within 60s"))
            proc.kill()
            proc.join(10)
        fleet.replace(proc)
