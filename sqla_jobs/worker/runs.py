"""A run and its outcome: what travels from the control loop to a handler and back.

``Run`` is one claimed job on its way through an executor (handler resolved once,
context, deadline, the flags ``abandon`` and a cancel request set); ``Outcome`` is
what became of it, waiting to be written: its ``result`` is the ending the outcome
policy (``sqla_jobs.worker.outcomes``) settles, or ``ok`` for the batched finish.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._context import JobContext
from ..drivers.base import Claimed

__all__ = ["InvalidResult", "Outcome", "Run", "outcome_of"]


class _ClaimLost(Exception):
    """The job's row was no longer ours when its transactional handler tried to finish it."""


class InvalidResult(Exception):
    """A handler returned a value that cannot be stored as its job's result (the payload rules)."""


class _CancelBeforeCommit(Exception):
    """A cancel request reached a transactional run before its commit: its writes are rolled back."""


@dataclass(slots=True)  # made per job: slots make it faster to build than a __dict__ (so for Outcome)
class Run:
    """One claimed job on its way through a handler thread."""

    job: Claimed
    handler: Any  # the queue's handler for job.kind, resolved once at claim; None for an unknown kind
    ctx: JobContext
    started: float
    deadline: float | None
    abandoned: bool = False  # timed out, lost or given back: the thread's result is discarded
    # Its transaction holds the fenced finish and is committing: from then on the
    # run's fate is that commit's, so it is never abandoned (see Executor.abandon).
    finishing: bool = False
    cancel_requested: bool = False  # a person's cancel request reached it: it ends cancelled
    task: Any = None  # an async handler's task and its loop, so a cancel can interrupt it
    loop: Any = None
    interrupted: bool = False
    returned: bool = False  # the handler returned (or raised): its outcome waits to be collected
    traces: dict[int, dict[str, str]] | None = None  # its claim's stored trace contexts (sqla_jobs.otel), if read


@dataclass(slots=True)
class Outcome:
    """What became of one run, waiting to be written."""

    job: Claimed
    result: str  # ok | committed | error | outage | snooze | cancel | lost
    duration: float
    error: str = ""
    delay: float = 0.0
    written: bool = False
    # The failure came after the fenced finish, from the commit itself: the commit may have
    # applied with its reply lost, so a write that finds the job no longer running checks.
    committing: bool = False
    value: Any = None  # what the handler returned (checked, JSON-able), stored with the finished job
    progress: Any = None  # its last progress value, if not written yet
    exception: BaseException | None = None  # what the handler raised, for a tracing span (sqla_jobs.otel)
    park: Any = None  # a durable sleep or wait (errors.JobParked) that ended the run: a ``snooze`` it decides


def outcome_of(run: Run, started: float) -> Callable[..., Outcome]:
    """``outcome(result, error, delay)`` for ``run``: cancelled whatever the result once a cancel request reached it."""
    job = run.job

    def outcome(result: str, error: str = "", delay: float = 0.0) -> Outcome:
        if run.cancel_requested and result != "committed":
            # The request reached the run: however the handler stopped, the job ends cancelled.
            how = "the handler returned" if result == "ok" else (error or result)
            return Outcome(job, "cancel", time.monotonic() - started, f"cancelled on request: {how}")
        return Outcome(job, result, time.monotonic() - started, error, delay)

    return outcome
