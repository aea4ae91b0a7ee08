"""What each outcome of a run does to its job row: the one policy, for every runner.

The threaded worker, the async worker, the ``--processes`` supervisor, the
lease reaper and the relay all end runs here; none decides on its own (a
source scan, ``tests/test_outcome_policy.py``, fails if another module calls
the driver's ``release`` / ``release_many`` / ``dead_letter``). Two halves:

* ``decide``: a pure function, (ending, attempt, max attempts, refunds so far,
  cancel requested) -> ``Verdict`` (next state, run_at delay, whether the
  attempt is refunded, the isolation mark, the error entry, the event name);
  pinned table-driven by the test above;
* ``settle`` / ``hand_back_lost`` / ``hand_back_unfinished``: apply a verdict
  through the driver, reading first only what the verdict depends on (a cancel
  request, the refunds so far), in the caller's transaction.

The vocabulary: a run *ends* with one of ``ENDINGS``; the policy *decides* a
verdict and *settles* it; a run that did not end (its runner was lost, or shut
down) is *handed back*. The driver only *finishes*, *releases* (back to
pending, or cancelled) and *dead-letters* (``drivers/_endings.py``).

A success is finished by the caller's batched ``finish_and_claim`` (the hot
path: no per-job work is added there); ``decide("ok", ...)`` states the rule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Engine

from .._app import JobEvent, JobQueue
from ..drivers.base import Driver, Fence

__all__ = [
    "ENDINGS",
    "MAX_UNCOUNTED_LOSSES",
    "MAX_UNCOUNTED_OUTAGES",
    "OUTAGE_MARK",
    "RELAY_MARK",
    "Verdict",
    "decide",
    "hand_back_lost",
    "hand_back_unfinished",
    "park_delay",
    "settle",
]

log = logging.getLogger("sqla_jobs.worker")

#: Attempts interrupted by an outage of the queue database are refunded this many times per job; after
#: that they count, so a handler that itself breaks the server (a query that crashes its backend) still
#: ends in the dead letters instead of retrying forever.
MAX_UNCOUNTED_OUTAGES = 10
#: A job's attempt is refunded this many times for a relay that died or a broker that went away while the
#: job was in flight; after that such losses count like failures, so a job can never circle forever.
MAX_UNCOUNTED_LOSSES = 10
#: Appended to the error of a refunded attempt; counting it in the job's error history is how the
#: refunds so far are known (no column of their own: the history already travels with the row).
OUTAGE_MARK = "(queue database unreachable, attempt not counted)"
RELAY_MARK = "(relay or broker lost, attempt not counted)"

#: How a run can end. ``ok``/``ack``: success; ``committed``: a transactional handler's commit finished it;
#: ``error``/``timeout``/``nack``/``unroutable``: the job's failure (retry or dead letter); ``outage``: the
#: queue database dropped during the run; ``broker_lost``: the broker went away with the message in flight;
#: ``relay_lost``: a relay died holding it; ``lost``: a worker died holding it (crash, lease out, process
#: exited); ``shutdown``: grace ran out; ``snooze`` / ``cancel``: the handler asked.
ENDINGS = ("ok", "ack", "committed", "error", "timeout", "nack", "unroutable", "outage", "broker_lost",
           "relay_lost", "lost", "shutdown", "snooze", "cancel")
_FAILURES = frozenset({"error", "timeout", "nack", "unroutable"})
#: Endings refunded a bounded number of times: the mark their refunds carry and the bound.
_REFUNDED = {"outage": (OUTAGE_MARK, MAX_UNCOUNTED_OUTAGES), "broker_lost": (RELAY_MARK, MAX_UNCOUNTED_LOSSES),
             "relay_lost": (RELAY_MARK, MAX_UNCOUNTED_LOSSES)}
#: Endings whose verdict changes when a cancel was requested during the run (so ``settle`` reads it).
_CANCELLABLE = _FAILURES | {"outage", "broker_lost", "relay_lost", "lost", "snooze"}


@dataclass(frozen=True)
class Verdict:
    """What one ending does to the job row."""

    event: str  #: finished | failed | outage | dead_letter | cancelled | snoozed | handed_back
    state: str  #: finished | pending | cancelled | dead
    delay: float = 0.0  #: seconds from now to the next run_at (pending only)
    refund: bool = False  #: the attempt is not counted (attempts goes back down by one)
    isolate: bool | None = False  #: the next run alone in its process; None: the mark is left as it was
    error: str | None = None  #: the error entry appended to ``errors`` (and ``last_error``); None: none


def decide(ending: str, attempt: int, max_attempts: int, refunds: int = 0, *, cancel_requested: bool = False,
           error: str = "", snooze: float = 0.0, retry_delay: Callable[[], float] = lambda: 0.0,
           pause: float = 0.0) -> Verdict:
    """The verdict for a run of attempt ``attempt`` (of ``max_attempts``) that ended ``ending``.

    ``refunds``: attempts of this job already refunded for the same cause (its mark in the error history).
    ``retry_delay``: called only when a counted failure is retried (the app's backoff, with jitter).
    ``pause``: the delay of a broker-lost refund (the relay's reconnect backoff).
    """
    if ending not in ENDINGS:
        raise ValueError(f"unknown ending {ending!r}")
    if ending in ("ok", "ack", "committed"):
        return Verdict("finished", "finished")
    if ending == "shutdown":
        # Not the job's fault and not a finished attempt: due now, refunded, and the isolation mark kept
        # (the run was interrupted, it did not end). A requested cancel still ends it (the release's SQL).
        return Verdict("handed_back", "pending", refund=True, isolate=None)
    if ending == "cancel" or (cancel_requested and ending in _CANCELLABLE):
        return Verdict("cancelled", "cancelled", error=error or None)
    if ending == "snooze":
        return Verdict("snoozed", "pending", delay=snooze, refund=True)
    if ending in _REFUNDED:
        mark, bound = _REFUNDED[ending]
        if refunds < bound:
            delay = pause if ending == "broker_lost" else 0.0
            return Verdict("outage", "pending", delay=delay, refund=True, error=f"{error} {mark}")
        # Refunded often enough: from now on it counts like a failure.
    if attempt >= max_attempts:
        return Verdict("dead_letter", "dead", error=error)
    if ending == "lost":
        # Counted, due now, and run alone next time: the run that killed the process may have been this one.
        return Verdict("failed", "pending", isolate=True, error=error)
    if ending == "relay_lost":
        return Verdict("failed", "pending", error=error)
    return Verdict("failed", "pending", delay=pause if ending == "broker_lost" else retry_delay(), error=error)


# -- applying verdicts through the driver -----------------------------------------------------------


def _apply(driver: Driver, conn: Connection, fence: Fence, attempt: int, verdict: Verdict) -> bool:
    """Write ``verdict`` for the run ``fence`` (fenced); whether the run was still ours."""
    if verdict.state == "dead":
        return driver.dead_letter(conn, fence, verdict.error or "")
    if verdict.state == "finished":
        return bool(driver.finish(conn, [fence]))
    return driver.release(conn, fence, delay=verdict.delay, error=verdict.error, attempt=attempt,
                          refund=verdict.refund, cancel=verdict.state == "cancelled", isolate=verdict.isolate)


def _refunds(driver: Driver, conn: Connection, fence: Fence, ending: str) -> int:
    """How many attempts of this job were already refunded for this ending's cause (a rare path: one read)."""
    mark = _REFUNDED[ending][0]
    return sum(mark in str(e.get("error", "")) for e in driver.errors_of(conn, fence))


def settle(driver: Driver, conn: Connection, fence: Fence, ending: str, attempt: int, max_attempts: int, *,
           error: str = "", snooze: float = 0.0, retry_delay: Callable[[], float] = lambda: 0.0,
           pause: float = 0.0, cancel_requested: bool | None = None) -> Verdict | None:
    """Decide and write the ending of one run, in the caller's transaction; None if the run was no longer
    ours (its lease ran out and someone took it over: nothing was written).

    ``cancel_requested``: None reads it when it matters; a caller that already knows it (a reaped row's
    ``cancelled_at``) passes it.
    """
    if cancel_requested is None:
        cancel_requested = ending in _CANCELLABLE and driver.cancel_requested(conn, fence)
    refunds = _refunds(driver, conn, fence, ending) if ending in _REFUNDED and not cancel_requested else 0
    verdict = decide(ending, attempt, max_attempts, refunds, cancel_requested=cancel_requested, error=error,
                     snooze=snooze, retry_delay=retry_delay, pause=pause)
    return verdict if _apply(driver, conn, fence, attempt, verdict) else None


def park_delay(driver: Driver, conn: Connection, job_id: int, park: Any) -> float:
    """A durable sleep or wait (``errors.JobParked``) ended the run: record where it parked, in the caller's
    transaction, and return the ``snooze``'s delay: 0 if the awaited event was emitted already, else the
    time left until the due time (sqla_jobs._durable)."""
    emitted = driver.park(conn, job_id, park.name, park.until, park.started, park.key)
    return 0.0 if emitted else max(0.0, (park.until - datetime.now(timezone.utc)).total_seconds())


def hand_back_unfinished(driver: Driver, conn: Connection, fences: list[Fence]) -> int:
    """Shutdown, grace over: the runs still going go back to the queue (``decide("shutdown")``); how many."""
    if not fences:
        return 0
    verdict = decide("shutdown", 0, 0)
    return driver.release_many(conn, fences, refund=verdict.refund, isolate=verdict.isolate)


_LOST_LOG = {
    "cancelled": "worker lost after a cancel request, job cancelled",
    "dead_letter": "worker lost on the last attempt, moved to dead letters",
    "failed": "worker lost, job handed back to the queue to run alone",
}


def hand_back_lost(queue: JobQueue[Any, Any], engine: Engine, driver: Driver,
                   find: Callable[[Connection], list[Any]], why: str, patience: float | None = None) -> int:
    """Hand back the runs of a lost worker that ``find`` returns (rows shaped like ``Driver.expired``'s).

    Two callers find such runs: the lease reaper (a worker stopped heartbeating: ``Driver.expired``) and
    the ``--processes`` supervisor, which sees its child die and hands back its runs at once instead of
    waiting a whole lease (``Driver.held_by``). ``why`` is formatted with ``row`` into the error entry,
    e.g. ``"worker {row.locked_by} stopped heartbeating (lease expired)"``. Per run, ``decide("lost")``:
    a cancel requested meanwhile is honoured; the lost attempt counts (dead letter on the last one);
    anything else is due now and marked ``isolate``, so its next run is alone in a worker process (one
    job at most killed the process; running each alone sorts the culprit from the bystanders). Hooks
    hear of each once the transaction has committed. Returns how many were handed back.

    ``patience`` (the reaper's): if starting the write transaction waited longer than that, hand back
    nothing this time. Only SQLite's write lock makes the start wait, and whoever held it that long was
    alive and may be the very worker whose leases look expired, frozen (a stopped process, a long pause)
    with the lock in hand: reaped the instant it resumes, its handler would still be running beside the
    retry. By the next turn it has renewed its leases, or it really is gone.
    """
    events = []
    began = time.monotonic()
    with driver.write(engine) as conn:
        if patience is not None and time.monotonic() - began > patience:
            log.info("the lease reaper waited %.1fs for the database's write lock: it looks again next turn",
                     time.monotonic() - began)
            return 0
        for row in find(conn):
            error = f"WorkerLost: {why.format(row=row)} during attempt {row.attempts}"
            verdict = settle(driver, conn, (row.id, row.claim_token), "lost", row.attempts, row.max_attempts,
                             error=error, cancel_requested=row.cancelled_at is not None)
            if verdict is None:
                continue
            log.warning("job %d %s attempt %d/%d: %s", row.id, row.kind, row.attempts, row.max_attempts,
                        _LOST_LOG[verdict.event])
            events.append(JobEvent(verdict.event, row.id, row.kind, row.queue, row.attempts, row.max_attempts,
                                   None, error))
    for event in events:
        queue.emit(event)
    return len(events)
