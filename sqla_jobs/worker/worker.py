"""The worker: claims due jobs, runs their handlers on threads, records the outcome.

::

    Worker(engine, queue, concurrency=8).run()          # until SIGTERM / SIGINT
    Worker(engine, queue).run(burst=True)               # every due job, then return
    Worker(engine, queue, queues={"default": 8, "emails": 2}).run()  # threads per queue

or ``sqla-jobs worker --url ... --app myapp.jobs:queue``.

One control thread talks to the database; ``concurrency`` handler threads only
run user code. With ``queues`` as a mapping of queue name to slots, each queue
gets that many threads of its own (``concurrency`` is their sum): a queue full
of slow jobs never delays another, and each queue is claimed in batches.
The parts (docs/development.md, "The worker's parts"):

* ``config.WorkerConfig``: the settings, checked once, and the pool rule;
* ``control.Control``: the control loop, decisions only;
* ``store.Store``: every read and write the loop asks for, through the driver;
* ``executor.Executor``: the handler threads, job context, transactional handlers;
* the driver's ``listener`` (PostgreSQL LISTEN/NOTIFY, ``drivers/postgresql/listen.py``);
* ``signals``: SIGTERM / SIGINT; ``supervisor``: ``--processes``.

The control loop, on each turn:

1. fails runs that passed their kind's timeout;
2. every ``heartbeat`` seconds extends the leases of running jobs and hands
   jobs whose lease ran out (their worker died) back to the queue;
3. writes failures, snoozes and cancels one by one (retry with backoff, or
   dead-letter on the last attempt);
4. in one round trip, marks the batch of successful runs finished and claims
   jobs for the free threads (``Driver.finish_and_claim``); successes wait up to
   ``flush_interval`` to be batched, and a claim waits until half the threads
   are free, unless the worker is idle; a job whose last worker was lost
   runs alone (claimed only by an idle worker, which then claims nothing
   else until it ends: see sqla_jobs.worker.outcomes);
5. sleeps until handler threads have something for it, a NOTIFY arrives
   (PostgreSQL) or ``poll_interval`` passes.

A database error on any step is logged and retried: at once after a lost
connection while the server answers (at most half a second apart while it does
not; see ``_reconnect.retry_pause``), with backoff after any other error. Outcomes
not yet written stay in memory and are written after reconnecting. They are
fenced by the claim token, so if the lease ran out meanwhile and another
worker took the job, the stale result is discarded and logged, never applied.
A handler that failed because a connection to the queue database dropped
under it (_outage.py) has its attempt refunded, not charged.

On SIGTERM or SIGINT the worker stops claiming, lets running handlers finish
for up to ``grace`` seconds, gives the rest back to the queue (the attempt is
refunded, the job runs again promptly) and returns 0. A second signal exits
at once; the leases cover whatever was running. A signal that arrives while
the worker starts is a stop too: it returns 0 before its first claim.

With ``prune_after`` (seconds; ``--prune-finished-older-than`` on the command
line) the control loop also deletes finished and cancelled jobs older than
that, one small batch at a time and one worker at a time (see
docs/howto/operations.md). With ``prune_after=0`` it keeps no finished jobs:
each is deleted by the statement that finishes it (``Driver.discarding_finished``).

Reaping and pruning are the elected worker's (``leader=True``, the default:
``sqla_jobs.leader``, renewed at each heartbeat, handed over on stop); with
``leader=False`` (``--no-leader``) and in burst mode every worker does them.
So is, with ``vacuum_dead_rows`` (``--vacuum-dead-rows``, PostgreSQL), a
``VACUUM`` of the jobs table once it holds that many dead rows: see
``sqla_jobs.worker.vacuum`` for when a burst needs it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from .._app import JobQueue
from .._periodic import Scheduler
from ..drivers.base import Driver
from ..leader import Leadership
from .config import WorkerConfig, WorkerSettings, check_pool, takes_settings
from .control import Control
from .executor import Executor
from .maintenance import Maintenance
from .outage import database_key
from .signals import installed_stop_signals, release_stop_signals, stop_signals
from .store import Store
from .vacuum import Vacuumer

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Worker"]

log = logging.getLogger("sqla_jobs.worker")


class Worker:
    """Runs jobs from ``queue`` using ``engine``. See the module docstring.

    The settings are checked by ``WorkerConfig`` (``ConfigError`` naming the
    wrong value), the same check ``sqla-jobs worker`` and ``bench`` go through.
    ``queues``: None (every queue), a list of names sharing ``concurrency``
    threads (default 4), or a mapping ``{name: slots}`` giving each queue its
    own threads (``concurrency``, if given, must be their sum).
    """

    @takes_settings
    def __init__(self, engine: Engine, queue: JobQueue[Any, Any], **settings: Unpack[WorkerSettings]) -> None:
        self._setup(engine, queue, WorkerConfig.from_settings(**settings))

    @classmethod
    def _from_config(cls, engine: Engine, queue: JobQueue[Any, Any], config: WorkerConfig) -> Worker:
        """A worker from settings already checked (the CLI, a supervised process, the bench)."""
        worker = cls.__new__(cls)
        worker._setup(engine, queue, config)
        return worker

    def _setup(self, engine: Engine, queue: JobQueue[Any, Any], config: WorkerConfig) -> None:
        self.config = config
        self.engine = engine
        self.queue = queue
        self.driver: Driver = queue.driver(engine)
        if config.discards_finished:  # delete at finish what would be pruned at once
            self.driver = self.driver.discarding_finished()
        self.name = config.worker_name
        self._listen = config.listen and self.driver.supports_listen  # asked for, and the database can
        check_pool(engine, config)
        self.driver.harden(engine, self.name)  # keepalives, timeouts, application_name: see the driver
        self._wake = threading.Event()
        self._store = Store(engine, queue, self.driver, self.name, config.lease, config.queues)
        self._executor = Executor(engine, queue, self.driver, config.concurrency, self.name,
                                  database_key(engine.url), self._wake, count_queues=config.slots is not None)
        self._maintenance = Maintenance(None)  # run() elects, unless burst or leader=False
        self._control = Control(config, self._store, self._executor, self._wake, self._maintenance)

    @property
    def processed(self) -> int:
        """Outcomes written so far (for tests and the bench)."""
        return self._store.processed

    def _reap(self) -> None:
        """One pass of the lease reaper on its own (the reliability tests race it against other writes)."""
        self._store.reap()

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (thread-safe)."""
        self._control.stopping = True
        self._wake.set()

    def run(self, *, burst: bool = False, install_signals: bool = True) -> int:
        """Process jobs until stopped (or, with ``burst``, until no job is due). Returns 0.

        With ``install_signals`` (on the main thread), SIGTERM and SIGINT stop
        the worker gracefully and a second one exits at once; the handlers that
        were there before are restored when ``run`` returns.
        """
        had_signals = installed_stop_signals() is not None
        signals = stop_signals() if install_signals else None
        try:
            self._store.prepare(self._listen, self.config.poll_interval)
            if self.config.leader and not burst:  # a burst worker keeps its own upkeep: it is gone soon
                self._maintenance.leadership = Leadership(self.engine, self.queue, self.name, lease=self.config.lease)
            self._executor.start()
            wake = self._control.wake_from_database
            listener = self.driver.listener(self.engine, wake, self.name) if self._listen else None
            if listener is not None:
                listener.start()
            # The app's periodic jobs: every long-running worker enqueues due slots (sqla_jobs._periodic).
            # Not only the elected worker: a slot must not wait for a new leader (up to a lease), and the
            # database lets one job per slot in whoever asks.
            scheduler = (Scheduler(self.queue, self.engine, prune_after=self.config.prune_after)
                         if self.queue.schedules and not burst else None)
            if scheduler is not None:
                scheduler.start()
            vacuumer = (Vacuumer(self.queue, self.engine, self.config.vacuum_dead_rows,
                                 lambda: self._maintenance.acting)
                        if self.config.vacuum_dead_rows is not None else None)
            if vacuumer is not None:
                vacuumer.start()
            if signals is not None:
                signals.attach(f"worker {self.name}", self.stop)
            log.info("worker %s started: %s", self.name, self.config.summary())
            try:
                self._control.run(burst)
            finally:
                if scheduler is not None:
                    scheduler.stop()
                if vacuumer is not None:
                    vacuumer.stop()
                self._maintenance.resign()  # the next worker takes the upkeep over at once
                if listener is not None:
                    listener.stop()
                self._store.close()
                self._executor.shutdown()
        finally:
            if signals is not None and not had_signals:
                release_stop_signals()
        log.info("worker %s stopped after %d job attempts", self.name, self.processed)
        return 0

