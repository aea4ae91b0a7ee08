"""``Relay``: claim jobs of chosen queues, publish each to a broker, finish them once the broker acknowledged.

One turn of the loop, for a batch:

1. claim up to ``batch`` due jobs of the relay's queues (``Driver.claim_batch``:
   a lease and a fresh claim token, like a worker's claim);
2. turn each into an ``Outgoing`` message and publish the whole batch, then wait
   for the broker's acknowledgement of every message (``Target.publish``);
3. finish the acknowledged jobs in one fenced write (``Driver.finish``); a message
   the broker refused (nacked) or had no route for is a failed attempt, settled by
   the outcome policy (``sqla_jobs.worker.outcomes``) like a handler's failure: the
   app's retry delay, the dead letters on its last attempt.

Delivery is at least once. The job row is finished only after the broker has
the message, so a relay killed between the two leaves the job ``running``; when
its lease runs out it is published again under the same id (``message_id`` /
``Nats-Msg-Id``), which the broker or the consumer deduplicates.

What never costs an attempt (up to ``MAX_UNCOUNTED_LOSSES`` times per job, then it
counts, so nothing can circle forever): the batch in flight when the broker
became unreachable, and the jobs of a relay that died (found by the relay's own
lease reaper). While the broker is unreachable the relay claims nothing: the jobs
wait ``pending`` in the table, untouched, however long the outage lasts, and the
relay tries the broker again with backoff (``reconnect``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from .._app import JobEvent, JobQueue
from .._backoff import Backoff
from ..drivers.base import Claimed
from ..errors import ConfigError
from ..worker.outcomes import MAX_UNCOUNTED_LOSSES, settle
from ..worker.reconnect import retry_pause
from ._message import BrokerUnavailable, Target, outgoing

__all__ = ["MAX_UNCOUNTED_LOSSES", "Relay", "RelayCounts"]

log = logging.getLogger("sqla_jobs.relay")

_WHAT = {"failed": "retry in {delay:.1f}s", "dead_letter": "moved to dead letters", "cancelled": "cancelled on request"}


@dataclass
class RelayCounts:
    """What a relay did since it started."""

    published: int = 0  #: jobs the broker acknowledged and the relay finished
    refused: int = 0  #: messages the broker refused (unroutable, nacked, no stream): failed attempts
    unrouted: int = 0  #: jobs of a kind the target has no route for: failed attempts
    interrupted: int = 0  #: jobs released because the broker went away while they were in flight
    reaped: int = 0  #: jobs of a dead relay handed back by this one's reaper
    reconnects: int = 0  #: connections to the broker made after the first


class Relay:
    """Hand the jobs of ``queues`` to a broker: ``Relay(engine, app, RabbitMQTarget(...), queues=["relay"])``.

    ``app`` is the ``JobQueue`` of the jobs table (its retry policy applies to
    refused messages). The relay takes every job of its queues, so give the
    relayed kinds a queue of their own that no worker serves
    (``Job(kind="order.created", queue="relay", ...)``). ``lease``: seconds a
    claim is held before another relay may take it over (a dead relay's jobs
    wait this long). ``confirm_timeout``: how long to wait for the broker's
    acknowledgements before the batch is taken as not delivered; keep it well
    under ``lease``. ``listen``: on PostgreSQL, wake up when a job is enqueued
    (LISTEN/NOTIFY, like a worker) instead of only every ``poll_interval``.
    """

    def __init__(
        self,
        engine: Engine,
        app: JobQueue[Any, Any],
        target: Target,
        *,
        queues: Sequence[str] = ("relay",),
        batch: int = 500,
        lease: float = 60.0,
        confirm_timeout: float = 15.0,
        poll_interval: float = 0.5,
        reconnect: Backoff | None = None,
        name: str | None = None,
        listen: bool = True,
    ) -> None:
        if isinstance(queues, str) or not queues or not all(isinstance(q, str) and q for q in queues):
            raise ConfigError(f"Relay queues must be a non-empty list of queue names, got {queues!r}")
        if not 1 <= batch <= 10_000:
            raise ConfigError(f"Relay batch must be between 1 and 10000 jobs, got {batch!r}")
        if lease <= 0 or confirm_timeout <= 0 or poll_interval <= 0:
            raise ConfigError("Relay lease, confirm_timeout and poll_interval must be > 0 seconds")
        if confirm_timeout * 2 > lease:
            raise ConfigError(f"Relay confirm_timeout ({confirm_timeout:g}s) must be at most half the lease "
                              f"({lease:g}s), or a slow broker would let the lease run out mid-publish")
        self.engine = engine
        self.app = app
        self.target = target
        self.queues = list(queues)
        self.batch = batch
        self.lease = lease
        self.confirm_timeout = confirm_timeout
        self.poll_interval = poll_interval
        self.reconnect = reconnect or Backoff(base=0.5, factor=2.0, cap=30.0)
        self.name = f"{socket.gethostname()}:{os.getpid()}:{name or 'relay'}"
        self.driver = app.driver(engine)
        self.counts = RelayCounts()
        self.listen = listen
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the LISTEN thread when a job is enqueued
        self._connected = False
        self._unfinished: list[Claimed] = []  # acknowledged by the broker, finish not yet written
        self._alone = False  # an isolated job (its last worker died) waits: claim it by itself
        self._next_reap = 0.0

    def __repr__(self) -> str:
        return f"<Relay {self.name} queues={self.queues} -> {self.target.describe()}>"

    # -- running ---------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the batch in flight, then return from ``run`` (thread- and signal-safe)."""
        self._stop.set()

    def run(self, *, until_idle: bool = False) -> RelayCounts:
        """Relay until ``stop()`` (or, with ``until_idle``, until no job of the queues is due)."""
        return asyncio.run(self.run_async(until_idle=until_idle))

    async def run_async(self, *, until_idle: bool = False) -> RelayCounts:
        log.info("relay %s: queues %s -> %s", self.name, ", ".join(self.queues), self.target.describe())
        failures = 0  # broker connection failures in a row
        self._connected = False
        listener = self.driver.listener(self.engine, self._wake.set, self.name) if self.listen else None
        if listener is not None:
            listener.start()
        try:
            while not self._stop.is_set():
                if not self._connected:
                    failures = await self._connect(failures)
                    continue
                try:
                    busy = await self._turn()
                except BrokerUnavailable as exc:
                    log.warning("relay %s: broker lost: %s; reconnecting", self.name, exc)
                    self._connected = False
                    failures = 1
                    continue
                except SQLAlchemyError as exc:  # the database: the same pause a worker takes
                    pause = retry_pause(self.driver, self.engine, exc, failures + 1)
                    failures += 1
                    log.warning("relay %s: database error, retry in %.1fs: %s", self.name, pause, exc)
                    await self._sleep(pause)
                    continue
                failures = 0
                if not busy:
                    if until_idle and not self._unfinished:
                        break
                    await self._sleep(self.poll_interval, wake=True)
        finally:
            if listener is not None:
                listener.stop()
            await self.target.close()
        log.info("relay %s: stopped; %s", self.name, self.counts)
        return self.counts

    async def _connect(self, failures: int) -> int:
        try:
            await self.target.connect()
        except BrokerUnavailable as exc:
            pause = self.reconnect.delay(failures + 1)
            log.warning("relay %s: broker unreachable, jobs wait in the table; retry in %.1fs: %s",
                        self.name, pause, exc)
            await self._sleep(pause)
            return failures + 1
        if failures:
            self.counts.reconnects += 1
            log.info("relay %s: broker reachable again", self.name)
        self._connected = True
        return 0

    async def _sleep(self, seconds: float, *, wake: bool = False) -> None:
        """Sleep ``seconds``, ending early on ``stop()`` and, with ``wake``, when a job is enqueued."""
        end = time.monotonic() + seconds
        while not self._stop.is_set() and not (wake and self._wake.is_set()) and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.05))

    async def _turn(self) -> bool:
        """One batch: claim, publish, finish. Returns whether there was anything to do."""
        if self._unfinished:
            await asyncio.to_thread(self._finish, self._unfinished)
            self._unfinished = []
        if time.monotonic() >= self._next_reap:
            await asyncio.to_thread(self._reap)
            self._next_reap = time.monotonic() + min(5.0, self.lease / 4)
        self._wake.clear()  # before the claim: a job enqueued from now on wakes the next sleep
        jobs = await asyncio.to_thread(self._claim)
        if not jobs:
            return self._alone
        routed = [outgoing(job) for job in jobs if self.target.route(job.kind) is not None]
        unrouted = [job for job in jobs if self.target.route(job.kind) is None]
        try:
            outcome = await self.target.publish(routed, self.confirm_timeout) if routed else {}
        except BrokerUnavailable as exc:
            await asyncio.to_thread(self._interrupted, jobs, str(exc))
            raise
        acked = [m.job for m in routed if outcome.get(m.job.id, "") is None]
        refused = [(m.job, outcome[m.job.id] or "") for m in routed if outcome.get(m.job.id) is not None]
        missing = [(m.job, "the broker gave no answer for it") for m in routed if m.job.id not in outcome]
        self._unfinished = acked
        await asyncio.to_thread(self._finish, acked)
        self._unfinished = []
        failed = [(job, "nack", error) for job, error in refused + missing]
        failed += [(job, "unroutable", self._no_route(job)) for job in unrouted]
        if failed:
            await asyncio.to_thread(self._fail, failed)
        self.counts.refused += len(refused) + len(missing)
        self.counts.unrouted += len(unrouted)
        return True

    def _no_route(self, job: Claimed) -> str:
        return (f"RelayNoRoute: the relay's target has no route for kind {job.kind!r}; "
                f"add one (routes={{{job.kind!r}: ...}} or --route {job.kind}=...)")

    # -- the database side (in a thread: the event loop keeps the broker connection alive) --------

    def _claim(self) -> list[Claimed]:
        with self.driver.write(self.engine) as conn:
            jobs, waiting = self.driver.claim_batch(conn, self.batch, self.name, uuid.uuid4().hex, self.lease,
                                                 self.queues, self._alone)
        self._alone = waiting
        return jobs

    def _finish(self, jobs: list[Claimed]) -> None:
        if not jobs:
            return
        with self.driver.write(self.engine) as conn:
            kept = self.driver.finish(conn, [job.fence for job in jobs])
        self.counts.published += len(kept)
        if len(kept) < len(jobs):
            # Their lease ran out first and someone took them over: they will be published again (same id).
            log.warning("relay %s: %d published job(s) were no longer ours to finish", self.name,
                        len(jobs) - len(kept))
        if self.app.listens("finished"):
            for job in jobs:
                if job.id in kept:
                    self._emit("finished", job)

    def _emit(self, name: str, job: Claimed, error: str | None = None) -> None:
        """Tell the app's hooks (``app.on(...)``, Prometheus counters) what happened, as a worker does."""
        self.app.emit(JobEvent(name, job.id, job.kind, job.queue, job.attempt, job.max_attempts, None, error))

    def _fail(self, failed: list[tuple[Claimed, str, str]]) -> None:
        """Refused (``nack``) or unroutable messages: failed attempts, as the outcome policy decides (the
        app's retry backoff, the dead letters on the last attempt, a cancel request honoured)."""
        events = []
        with self.driver.write(self.engine) as conn:
            for job, ending, error in failed:
                verdict = settle(self.driver, conn, job.fence, ending, job.attempt, job.max_attempts, error=error,
                                 retry_delay=lambda job=job: self.app.retry_delay(job.kind, job.attempt))
                if verdict is None:
                    continue
                events.append((verdict.event, job, error))
                log.warning("job %d %s: %s; %s", job.id, job.kind, error, _WHAT.get(verdict.event, verdict.event)
                            .format(delay=verdict.delay))
        for name, job, error in events:  # after the commit, like the worker's hooks
            self._emit(name, job, error)

    def _interrupted(self, jobs: list[Claimed], why: str) -> None:
        """The broker went away mid-batch: every job of it goes back (the policy's ``broker_lost``: the
        attempt refunded, a bounded number of times), due after the first reconnect pause."""
        pause = self.reconnect.delay(1)
        with self.driver.write(self.engine) as conn:
            for job in jobs:
                settle(self.driver, conn, job.fence, "broker_lost", job.attempt, job.max_attempts,
                       error=f"BrokerUnavailable: {why}", pause=pause)
        self.counts.interrupted += len(jobs)

    def _reap(self) -> None:
        """Hand back the jobs of a relay that died (lease expired) in this relay's queues (the policy's
        ``relay_lost``: refunded a bounded number of times, a cancel request honoured)."""
        with self.driver.write(self.engine) as conn:
            rows = [r for r in self.driver.expired(conn, limit=self.batch * 4) if r.queue in self.queues]
            for row in rows:
                settle(self.driver, conn, (row.id, row.claim_token), "relay_lost", row.attempts, row.max_attempts,
                       error=f"RelayLost: relay {row.locked_by} stopped before the broker acknowledged",
                       cancel_requested=row.cancelled_at is not None)
        if rows:
            self.counts.reaped += len(rows)
            log.warning("relay %s: handed back %d job(s) of a relay whose lease expired", self.name, len(rows))
