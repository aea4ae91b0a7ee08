"""Jobs whose worker was lost: the rules for handing them back, in one place.

Two callers find such jobs: the worker's lease reaper (a worker stopped
heartbeating: ``Driver.expired``) and the ``--processes`` supervisor, which sees
its child process die and hands back that child's jobs at once instead of
waiting a whole lease (``Driver.held_by``). Either way, per job:

* a cancel requested meanwhile is honoured (the job ends ``cancelled``);
* the lost attempt counts, so a job lost on its last attempt is dead-lettered;
* anything else goes back to ``pending``, due now, marked ``isolate``: its
  next run is alone in a worker process. When a process dies, every job it ran
  is handed back, but only one of them (at most) killed it; running each alone
  next time sorts the culprit from the jobs that merely shared the process,
  which then finish, while the culprit's next crash costs no one else an attempt.

Hooks hear of each hand-back once the transaction has committed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine

from .._app import JobEvent, JobQueue
from ..drivers import Driver

__all__ = ["hand_back"]

log = logging.getLogger("sqla_jobs.worker")


def hand_back(
    queue: JobQueue[Any, Any],
    engine: Engine,
    driver: Driver,
    find: Callable[[Connection], list[Any]],
    why: str,
) -> int:
    """Hand back the jobs ``find`` returns (rows shaped like ``Driver.expired``'s); returns how many.

    ``why`` is formatted with ``row`` and ends up in the job's error history,
    e.g. ``"worker {row.locked_by} stopped heartbeating (lease expired)"``.
    """
    events = []
    with driver.write(engine) as conn:
        for row in find(conn):
            error = f"WorkerLost: {why.format(row=row)} during attempt {row.attempts}"
            fence = (row.id, row.claim_token)
            if row.cancelled_at is not None:
                driver.release(conn, fence, error=error, attempt=row.attempts, cancel=True)
                name, what = "cancelled", "worker lost after a cancel request, job cancelled"
            elif row.attempts >= row.max_attempts:
                driver.dead_letter(conn, fence, error)
                name, what = "dead_letter", "worker lost on the last attempt, moved to dead letters"
            else:
                driver.release(conn, fence, error=error, attempt=row.attempts, isolate=True)
                name, what = "failed", "worker lost, job handed back to the queue to run alone"
            log.warning("job %d %s attempt %d/%d: %s", row.id, row.kind, row.attempts, row.max_attempts, what)
            events.append(JobEvent(name, row.id, row.kind, row.queue, row.attempts, row.max_attempts, None, error))
    for event in events:
        queue.emit(event)
    return len(events)
