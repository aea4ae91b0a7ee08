"""Self-fencing: a worker that cannot renew its leases stops its handlers before the leases run out.

A lease is the promise that no other worker runs the job. When a worker cannot
reach the database (a silent network partition: packets dropped, no reset, so
its control thread may hang in a read for as long as TCP keepalives take), it
cannot renew its leases, and once they run out another worker's reaper hands
the jobs to someone else. Were its handlers still running then, a job would run
twice at once, which the fencing token cannot undo for a handler that sends
e-mails or calls an API.

So a watchdog thread, independent of the control thread (which may be the one
hanging), looks at each run: once its lease was last renewed (claimed, or
kept by a heartbeat) more than ``FENCE_AT`` of the lease ago, the run is
abandoned. Its handler is told (``job.cancelled`` is set; an async handler gets
``CancelledError``), a transactional handler's session is rolled back instead
of committed, and its result is discarded: the worker reports nothing it
cannot write. No claim is made until a heartbeat succeeds again; then each
stopped job still under this worker's claim is handed back to the queue with
its attempt refunded (it was not at fault) once its handler has returned, and
work resumes. Until its handler returns, its lease is renewed with the others:
a handler that ignores the cancel goes on, and its job must not start anywhere
else meanwhile.

With the defaults (lease 60 s, heartbeat every 20 s) a worker fences itself
40 s after its last renewal, so one late heartbeat is not enough. A handler
that never looks at ``job.cancelled`` cannot be stopped (threads cannot be
killed): keep long handlers cooperative. SQLite has no network between the
worker and its database, so there a late heartbeat only means a busy write
lock, and the driver turns fencing off (``Driver.self_fencing``).
"""

from __future__ import annotations

import logging
import threading
import time

from ..drivers.base import Fence
from .executor import Executor
from .store import Store

__all__ = ["FENCE_AT", "LeaseGuard"]

log = logging.getLogger("sqla_jobs.worker")

#: The share of the lease after its last renewal at which a run is stopped (two heartbeats missed).
FENCE_AT = 2 / 3


class LeaseGuard:
    """Watches the runs of one ``Executor`` and stops those whose lease could not be renewed in time."""

    def __init__(self, executor: Executor, lease: float, worker_name: str, enabled: bool = True) -> None:
        self.executor = executor
        self.limit = lease * FENCE_AT
        self.worker_name = worker_name
        self.enabled = enabled
        self.renewed_at = time.monotonic()  # when the last successful heartbeat was sent
        self.fenced: list[Fence] = []  # stopped runs, to hand back once the database answers
        self.active = False  # a run was stopped since the last renewal: claim nothing
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, daemon=True, name="sqla-jobs-lease-guard")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> LeaseGuard:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def renewed(self, sent_at: float, store: Store) -> None:
        """A heartbeat sent at ``sent_at`` (monotonic) succeeded: every lease still held runs from then, and
        the runs stopped meanwhile, still this worker's unless reaped, go back to the queue (attempt refunded)."""
        running = self.executor.running
        with self._lock:
            self.renewed_at = max(self.renewed_at, sent_at)
            # Only once its handler has returned: a handler that ignores the cancel still runs, and the job
            # must not run elsewhere meanwhile (``held`` keeps its lease renewed until then).
            stopped = [fence for fence in self.fenced if fence not in running]
        if stopped:
            given = store.hand_back(stopped)  # a database error leaves them for the next heartbeat
            log.warning("worker %s: the database answers again: %d stopped job(s) handed back, claiming resumes",
                        self.worker_name, given)
        gone = set(stopped)
        with self._lock:
            self.fenced = [fence for fence in self.fenced if fence not in gone]
            self.active = False

    def held(self) -> list[Fence]:
        """The stopped runs whose handler has not returned yet: their leases are still renewed."""
        running = self.executor.running
        with self._lock:
            return [fence for fence in self.fenced if fence in running]

    def check(self, now: float) -> int:
        """Stop each run whose lease was last renewed more than ``FENCE_AT`` of the lease ago; how many."""
        ex = self.executor
        with self._lock:
            renewed_at = self.renewed_at
        # A copy of the values: the control thread adds and removes runs meanwhile.
        # Not a run whose handler has returned: nothing runs any more, and its outcome is written (fenced by
        # its claim token) once the database answers, or discarded if the job was taken over meanwhile.
        overdue = [run for run in list(ex.running.values())
                   if not (run.abandoned or run.returned) and now - max(run.started, renewed_at) > self.limit]
        stopped = [run for run in overdue if ex.abandon(run)]  # not one that is committing its finish
        if not stopped:
            return 0
        with self._lock:
            self.fenced += [run.job.fence for run in stopped]
            self.active = True
        log.warning("worker %s: leases not renewed for %.1fs (the database does not answer): stopped %d running "
                    "job(s) before their lease runs out, so that no other worker runs them beside this one; "
                    "they go back to the queue", self.worker_name, now - renewed_at, len(stopped))
        return len(stopped)

    def _watch(self) -> None:
        period = max(0.05, self.limit / 8)
        while not self._stop.wait(period):
            self.check(time.monotonic())
