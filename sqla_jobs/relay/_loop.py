"""``Relay``: a worker whose executor publishes each claimed job to a broker and whose success is the ack.

The relay runs the worker's own control loop (``sqla_jobs.worker.control.Control``)
with ``PublishExecutor`` (``_publish.py``) for its executor and ``RelayStore``
(``_store.py``) for its store, so claims, heartbeats (which renew the leases of
the batches in flight), the reaper, the outcome policy, database-error retries and
the stop are the worker's. A turn, for a batch:

1. the control loop claims up to ``batch`` due jobs of the relay's queues (a lease
   and a fresh claim token, like a worker's claim), only while the broker answers;
2. the executor turns each into an ``Outgoing`` message, publishes the whole batch
   on the relay's event loop and awaits the broker's acknowledgement of every
   message (``Target.publish``);
3. the acknowledged jobs are finished by the control loop's next batched write,
   together with the next claim (on PostgreSQL at the same time, on a second
   connection: ``RelayStore.finish_and_claim``); a message the
   broker refused (``nack``) or had no route for (``unroutable``) is a failed
   attempt, settled by the outcome policy (``sqla_jobs.worker.outcomes``) like a
   handler's failure: the app's retry delay, the dead letters on its last attempt.

Batches overlap: the control loop has a "thread" per job the relay may hold
(``in_flight``: about 4,000 jobs, 2 to 8 batches), so it claims the next batches
while earlier ones await their acks, and each batch's finish carries a further
claim; each batch is still finished only for its own acknowledgements.

Delivery is at least once. The job row is finished only after the broker has
the message, so a relay killed between the two leaves the job ``running``; when
its lease runs out it is published again under the same id (``message_id`` /
``Nats-Msg-Id``), which the broker or the consumer deduplicates.

What never costs an attempt (up to ``MAX_UNCOUNTED_LOSSES`` times per job, then it
counts, so nothing can circle forever): the batches in flight when the broker
became unreachable (``broker_lost``), and the jobs of a relay that died (found by
the relay's lease reaper: ``relay_lost``). While the broker is unreachable the
relay claims nothing: the jobs wait ``pending`` in the table, untouched, however
long the outage lasts, and the relay tries the broker again with backoff
(``reconnect``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine

from .._app import JobQueue
from .._backoff import Backoff
from ..drivers.base import Listener
from ..errors import ConfigError
from ..worker.config import WorkerConfig
from ..worker.control import Control
from ..worker.outcomes import MAX_UNCOUNTED_LOSSES
from ._counts import RelayCounts
from ._message import Target
from ._publish import PublishExecutor
from ._store import RelayStore

__all__ = ["MAX_UNCOUNTED_LOSSES", "Relay", "RelayCounts"]

log = logging.getLogger("sqla_jobs.relay")

#: Jobs a relay holds at once, claimed or awaiting their acks: batches claimed and published while earlier
#: ones await theirs. One batch at a time left the broker idle during each claim and the database idle
#: during each publish. On the 2-core test machine, batch 500, to NATS: 4 batches 15,100-18,300 jobs/s,
#: 8 batches 19,900-21,900, 12 and 16 no better (RabbitMQ gained from 8 too). A relay that dies leaves
#: this many jobs at most to be published again once their leases run out, so large batches get fewer
#: of them (2 at least: with one, nothing overlaps). The default batch is 1,000 (4 in flight): half the
#: statements per job of 500, and 0.71 of nats-py's ceiling against 0.63 (docs/performance.md).
IN_FLIGHT_JOBS = 4000


def in_flight(batch: int) -> int:
    """How many jobs a relay with this ``batch`` holds at once: 2 to 8 batches, about ``IN_FLIGHT_JOBS``."""
    return batch * max(2, min(8, IN_FLIGHT_JOBS // batch))


class Relay:
    """Hand the jobs of ``queues`` to a broker: ``Relay(engine, app, RabbitMQTarget(...), queues=["relay"])``.

    ``app`` is the ``JobQueue`` of the jobs table (its retry policy applies to
    refused messages). The relay takes every job of its queues, so give the
    relayed kinds a queue of their own that no worker serves
    (``Job(kind="order.created", queue="relay", ...)``). ``lease``: seconds a
    claim lasts without a heartbeat (the relay renews the leases of its batch in
    flight every ``min(5, lease / 4)`` seconds), so a dead relay's jobs wait at
    most this long before another relay takes them over. ``confirm_timeout``: how long to wait for the broker's
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
        batch: int = 1000,
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
        # A worker's connection settings (PostgreSQL: keepalives and timeouts, so a relay that vanishes mid-
        # transaction has its session ended and its locks released within seconds; and application_name, which
        # names the relay in pg_stat_activity). Without them a killed relay's last finish could still commit
        # long after it was gone, unseen.
        self.driver.harden(engine, self.name)
        self.counts = RelayCounts()
        self.listen = listen
        self._stop = threading.Event()
        self._control: Control | None = None
        # The worker's settings for the relay's control loop: a "thread" per job in flight (in_flight),
        # claimed a batch at a time (so the next batches are claimed and published while the last ones' acks
        # are on their way, and each batch's finish carries a further claim in its round trip), heartbeats
        # that renew the leases of a slow publish and reap a dead relay's jobs as often as the relay's own
        # reaper did, and a grace that covers one publish's confirms at a stop.
        self._config = WorkerConfig(
            concurrency=in_flight(batch), batch_size=batch, queues=self.queues, lease=lease,
            heartbeat=min(5.0, lease / 4), poll_interval=poll_interval, grace=confirm_timeout + 1.0, listen=listen,
            name=self.name, leader=False,
        )

    def __repr__(self) -> str:
        return f"<Relay {self.name} queues={self.queues} -> {self.target.describe()}>"

    # -- running ---------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the batches in flight, then return from ``run`` (thread- and signal-safe)."""
        self._stop.set()
        control = self._control
        if control is not None:
            control.stopping = True
            control.wake.set()

    def run(self, *, until_idle: bool = False) -> RelayCounts:
        """Relay until ``stop()`` (or, with ``until_idle``, until no job of the queues is due)."""
        return asyncio.run(self.run_async(until_idle=until_idle))

    async def run_async(self, *, until_idle: bool = False) -> RelayCounts:
        log.info("relay %s: queues %s -> %s", self.name, ", ".join(self.queues), self.target.describe())
        loop = asyncio.get_running_loop()
        wake = threading.Event()
        executor = PublishExecutor(self.engine, self.app, self.driver, self.batch, self.name, wake, loop,
                                   self.target, self.confirm_timeout, self.reconnect, self.counts)
        store = RelayStore(self.engine, self.app, self.driver, self.name, self.lease, self.queues, self.batch,
                           self.counts)
        control = Control(self._config, store, executor, wake)  # Maintenance(None): it reaps its queues itself
        control.stopping = self._stop.is_set()
        self._control = control
        listen = self.listen and self.driver.supports_listen
        listener = self.driver.listener(self.engine, control.wake_from_database, self.name) if listen else None
        executor.start()
        # The control loop's statements are blocking calls: on a thread of their own, while this loop keeps
        # the broker connection and its confirms going.
        turning = asyncio.ensure_future(asyncio.to_thread(self._turn, control, store, listener, until_idle))
        try:
            try:
                await asyncio.shield(turning)
            except asyncio.CancelledError:
                if not turning.done():  # a graceful stop, as AsyncWorker's: the batches in flight settle first
                    self.stop()
                    await asyncio.shield(turning)
                raise
        finally:
            await executor.close()
            await self.target.close()
            self._control = None
        log.info("relay %s: stopped; %s", self.name, self.counts)
        return self.counts

    def _turn(self, control: Control, store: RelayStore, listener: Listener | None, until_idle: bool) -> None:
        """The control loop (the worker's), on its thread, until stopped or, with ``until_idle``, idle."""
        store.prepare(listener is not None, self.poll_interval)
        if listener is not None:
            listener.start()
        try:
            control.run(until_idle)
        finally:
            if listener is not None:
                listener.stop()
            store.close()
