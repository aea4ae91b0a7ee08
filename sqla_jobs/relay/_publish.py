"""``PublishExecutor``: the relay's executor. Running a claimed job means publishing it to the broker.

The relay is a worker (``sqla_jobs.worker.control.Control`` claims, heartbeats,
reaps, writes outcomes through the outcome policy); only what "run" means
differs, so this is an ``Executor`` whose one "handler thread" is the relay's
event loop, where the broker connection lives:

* ``submit`` records each claimed job as a ``Run`` (no handler, no job context:
  no user code runs) and ``flush``, called once per claim, hands the claim's runs
  to the loop as one batch (``call_soon_threadsafe``): one publish, its
  confirms awaited together, as the relay always did;
* each message's answer becomes an ``Outcome`` on the executor's done queue, as a
  handler thread's would: an acknowledgement is ``ok`` (finished by the control
  loop's batched ``finish_and_claim``, with the next claim in the same round trip),
  a refusal ``nack``, a kind without a route ``unroutable`` (both: the policy's
  retry backoff, the dead letters on the last attempt), and a broker that went
  away ``broker_lost`` for the whole batch (refunded, bounded);
* ``accepting`` is False while the broker is unreachable, so the control loop
  claims nothing: the jobs wait ``pending``, untouched, however long the outage;
  a task reconnects with the relay's backoff and wakes the control loop once
  the broker answers again;
* with tracing on (``sqla_jobs.otel``), each message carries its job's stored
  trace context in the ``traceparent`` and ``tracestate`` headers (one read per batch).

A message cannot be recalled once sent, so a cancel request does not interrupt a
publish; it is honoured when the outcome is settled (a refused message of a job
someone cancelled ends ``cancelled``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from sqlalchemy import Engine

from .._app import JobQueue
from .._backoff import Backoff
from ..drivers.base import Claimed, Driver
from ..worker.executor import Executor
from ..worker.outage import database_key
from ..worker.runs import Outcome, Run
from ._counts import RelayCounts
from ._message import BrokerUnavailable, Outgoing, Target, outgoing

__all__ = ["PublishExecutor"]

log = logging.getLogger("sqla_jobs.relay")

_NO_ANSWER = "the broker gave no answer for it"


class PublishExecutor(Executor):
    """Publishes the runs of each claim as one batch on ``loop`` (see the module docstring)."""

    def __init__(self, engine: Engine, app: JobQueue[Any, Any], driver: Driver, batch: int, name: str,
                 wake: threading.Event, loop: asyncio.AbstractEventLoop, target: Target, confirm_timeout: float,
                 reconnect: Backoff, counts: RelayCounts) -> None:
        super().__init__(engine, app, driver, batch, name, database_key(engine.url), wake)
        self.target = target
        self.confirm_timeout = confirm_timeout
        self.reconnect = reconnect
        self.counts = counts
        self._loop = loop
        self._batch: list[Run] = []  # submitted by the current claim, not yet handed to the loop
        self._tasks: set[asyncio.Task[None]] = set()  # a strong reference: the loop keeps only weak ones
        self._connecting: asyncio.Task[None] | None = None
        self.accepting = False  # until the broker answers

    # -- the control loop's side (its thread) --------------------------------------------------------

    def start(self) -> None:
        """Connect to the broker (on the loop's thread, before the control loop starts)."""
        self._connect_later(0)

    def submit(self, job: Claimed, now: float) -> Run:
        # No handler and no context (they cost per job and nothing here runs user code).
        run = Run(job, None, None, now, None)  # type: ignore[arg-type]
        self.running[job.fence] = run
        self._batch.append(run)
        return run

    def flush(self) -> None:
        runs, self._batch = self._batch, []
        if runs:
            self._loop.call_soon_threadsafe(self._launch, runs)

    def abandon(self, run: Run) -> bool:
        """The lease was lost: whatever the broker answers, the result is discarded (the job is someone
        else's now; a second publish under the same id is what at-least-once allows)."""
        with self._fate:
            if not run.abandoned:
                run.abandoned = True
                self._abandoned += 1
        return True

    def deliver_cancel(self, run: Run) -> bool:
        return False  # a message in flight cannot be recalled; the policy honours the request when settling

    def shutdown(self) -> None:
        """Nothing to stop: the loop's tasks end with ``close``."""

    # -- the loop's side -------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop reconnecting and wait for the publishes in flight (each bounded by ``confirm_timeout``)."""
        if self._connecting is not None:
            self._connecting.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _launch(self, runs: list[Run]) -> None:
        task = self._loop.create_task(self._publish(runs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, runs: list[Run]) -> None:
        started = time.monotonic()
        if not self.accepting:
            # Claimed just as the broker was found gone (the claim raced the news): never publish on a
            # connection being replaced (a publish there may wait on a client that is reconnecting).
            self._interrupted(runs, "the broker was lost while this batch was being claimed", 0.0)
            return
        routed = [(run, outgoing(run.job)) for run in runs if self.target.route(run.job.kind) is not None]
        tracing = self.queue.tracing  # sqla_jobs.otel
        spans = await self._trace_headers([message for _, message in routed]) if tracing and routed else {}
        try:
            answers = await self.target.publish([m for _, m in routed], self.confirm_timeout) if routed else {}
        except BrokerUnavailable as exc:
            if spans:
                tracing.published(spans, {}, f"BrokerUnavailable: {exc}")
            self._lost(runs, exc, time.monotonic() - started)
            return
        if spans:
            tracing.published(spans, answers, None)
        took = time.monotonic() - started
        done = self._done
        refused = 0
        for run, message in routed:
            answer = answers.get(message.job.id, _NO_ANSWER)
            if answer is None:
                done.put((run, Outcome(run.job, "ok", took)))
            else:
                refused += 1
                done.put((run, Outcome(run.job, "nack", took, answer)))
        unrouted = len(runs) - len(routed)
        if unrouted:
            for run in runs:
                if self.target.route(run.job.kind) is None:
                    done.put((run, Outcome(run.job, "unroutable", took, _no_route(run.job))))
        self.counts.refused += refused
        self.counts.unrouted += unrouted
        self._wake.set()

    async def _trace_headers(self, messages: list[Outgoing]) -> dict[int, Any]:
        """Send each message whose job has a stored trace context in a span of its own, child of the enqueuing
        span, whose context goes in the headers (``traceparent``, ``tracestate``): the consumer's span continues
        the trace of the request that enqueued the job. The spans, by job id (``published`` ends them)."""
        try:
            contexts = await self.trace_contexts_async([message.job.id for message in messages])
        except Exception as exc:  # the database is away: the messages go without them, the publish goes on
            log.warning("relay: could not read the jobs' trace contexts: %s", str(exc).splitlines()[0])
            return {}
        system = getattr(self.target, "system", "broker")
        return self.queue.tracing.publish(system, messages, contexts, self.target.route)  # type: ignore[no-any-return]

    def _lost(self, runs: list[Run], exc: BrokerUnavailable, took: float) -> None:
        """The broker went away mid-batch: every job of it goes back (the policy's ``broker_lost``), and
        nothing is claimed until the broker answers again."""
        log.warning("relay %s: broker lost: %s; reconnecting", self.worker_name, exc)
        self.accepting = False
        self._interrupted(runs, str(exc), took)
        self._connect_later(1)

    def _interrupted(self, runs: list[Run], why: str, took: float) -> None:
        pause = self.reconnect.delay(1)  # due again after the first reconnect pause
        for run in runs:
            self._done.put((run, Outcome(run.job, "broker_lost", took, f"BrokerUnavailable: {why}", pause)))
        self.counts.interrupted += len(runs)
        self._wake.set()

    def _connect_later(self, failures: int) -> None:
        if self._connecting is None or self._connecting.done():
            self._connecting = self._loop.create_task(self._connect(failures))

    async def _connect(self, failures: int) -> None:
        """Connect, retrying with the relay's backoff; then let the control loop claim again."""
        while True:
            try:
                await self.target.connect()
            except BrokerUnavailable as exc:
                pause = self.reconnect.delay(failures + 1)
                log.warning("relay %s: broker unreachable, jobs wait in the table; retry in %.1fs: %s",
                            self.worker_name, pause, exc)
                failures += 1
                await asyncio.sleep(pause)
                continue
            if failures:
                self.counts.reconnects += 1
                log.info("relay %s: broker reachable again", self.worker_name)
            self.accepting = True
            self._wake.set()
            return


def _no_route(job: Claimed) -> str:
    return (f"RelayNoRoute: the relay's target has no route for kind {job.kind!r}; "
            f"add one (routes={{{job.kind!r}: ...}} or --route {job.kind}=...)")
