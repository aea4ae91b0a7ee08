"""What runs beside the soak's workers, in the parent process: the producer at a steady rate, the pruner,
the vacuumer, the collector of the workers' handler starts, and ``Tally``, what they have seen so far.

Each is a thread that ``soak.soak_run`` starts and stops; the windows are made of their figures by
``soak_monitor``.
"""

from __future__ import annotations

import queue as queue_module
import threading
import time
from array import array
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from .run import queue

__all__ = ["CATCH_UP_BATCH", "MAX_RATE_BATCH", "TICK", "Tally", "collect", "produce", "prune", "vacuum"]

TICK = 0.01  # the producer's step at a set rate: one transaction per tick
MAX_RATE_BATCH = 500  # jobs per transaction with --rate max
CATCH_UP_BATCH = 5_000  # most jobs one tick may carry when the producer fell behind


class Tally:
    """What the parent has seen so far, shared by its threads (each field written by one thread)."""

    def __init__(self) -> None:
        self.enqueue_times: array[float] = array("d")  # wall time of each producer transaction
        self.enqueue_counts: array[int] = array("q")
        self.sent = 0
        self.pruned = 0
        self.vacuums = 0
        self.seen = bytearray()
        self.duplicates = 0
        self.unique = 0
        self.latency_by_window: dict[int, array[float]] = {}

    def record_starts(self, chunk: list[tuple[float, int, float]], origin: float, window: float) -> None:
        for started, n, pickup in chunk:
            if n >= len(self.seen):
                self.seen.extend(bytes(max(n + 1 - len(self.seen), 65_536)))
            if self.seen[n]:
                self.duplicates += 1
            else:
                self.unique += 1
            self.seen[n] = 1
            index = int((started - origin) // window)
            self.latency_by_window.setdefault(index, array("d")).append(pickup * 1000)


def produce(engine: Engine, rate: float | None, tally: Tally, stop: threading.Event) -> None:
    """``rate`` jobs per second (None: as fast as it can) by ``enqueue_many``, one transaction per tick."""
    start = time.perf_counter()
    while not stop.is_set():
        if rate is None:
            count = MAX_RATE_BATCH
        else:
            count = min(int(rate * (time.perf_counter() - start)) - tally.sent, CATCH_UP_BATCH)
            if count <= 0:
                time.sleep(TICK)
                continue
        stamp = time.time()
        first = tally.sent
        rows = ({"kind": "soak", "payload": {"n": first + i, "t": stamp}} for i in range(count))
        with Session(engine) as session, session.begin():
            queue.enqueue_many(session, rows)
        tally.enqueue_times.append(stamp)
        tally.enqueue_counts.append(count)
        tally.sent += count


def prune(engine: Engine, older_than: float, tally: Tally, stop: threading.Event) -> None:
    """What ``sqla-jobs prune --finished-older-than AGE`` run every second would do."""
    while not stop.wait(1.0):
        tally.pruned += queue.prune(engine, older_than=older_than, batch_size=5_000)


def vacuum(engine: Engine, every: float, tally: Tally, stop: threading.Event) -> None:
    """``VACUUM jobs`` every ``every`` seconds: autovacuum's work where the server's is off or too slow."""
    while not stop.wait(every):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            queue.driver(conn).bench_vacuum(conn)
        tally.vacuums += 1


def collect(starts: Any, tally: Tally, origin: float, window: float, stop: threading.Event) -> None:
    while True:
        try:
            chunk = starts.get(timeout=0.2)
        except queue_module.Empty:
            if stop.is_set():
                return
            continue
        tally.record_starts(chunk, origin, window)
