"""The async worker: the same worker, on an ``AsyncEngine`` and one event loop.

::

    worker = AsyncWorker(async_engine, queue, concurrency=50)
    await worker.run()                      # until cancelled or worker.stop()
    await worker.run(burst=True)            # every due job, then return

or ``sqla-jobs worker --async`` (picked by itself for an async URL such as
``postgresql+psycopg_async://`` or ``sqlite+aiosqlite://``).

It keeps every decision of the threaded worker by running the same control
loop (``control.Control``) and the same ``Store``, and replaces what touches
threads and the database connection (docs/development.md, "The worker's parts"):

* the control loop runs in a greenlet on the event loop (SQLAlchemy's bridge,
  what ``AsyncConnection.run_sync`` does): each statement of ``Store`` and the
  driver is awaited on the async driver, so handler tasks run whenever the loop
  waits on the database, and the loop's sleep (``AsyncWake.wait``) awaits too;
* ``async_executor.AsyncExecutor`` runs each job as a task (``async def``
  handlers natively, plain ones on threads), with timeouts, cancel
  requests and lost leases delivered by cancelling the task;
* the wake-up is ``AsyncWake``, an event the control greenlet awaits and any
  task or thread (PostgreSQL's LISTEN, a signal handler) can set;
* PostgreSQL's LISTEN is a task on the loop too (``Driver.async_listener``,
  ``drivers/postgresql/async_listen.py``), on a connection out of the ``AsyncEngine``: a
  notification sets ``AsyncWake`` in the loop's own thread, with no thread hop;
* what runs on threads of its own (the periodic-jobs scheduler, plain
  transactional handlers) uses an engine through the sync twin of the async
  driver (``Driver.sync_url``): a thread cannot use the loop's connections.

So heartbeats, leases, fencing, the reaper and the maintenance leader, retry
backoff, dead letters, poison isolation, hooks and metrics are the threaded
worker's, unchanged. Cancelling the task that awaits ``run()`` is a graceful
stop (running jobs get ``grace`` seconds, the rest are given back), after which
the cancellation goes on; ``stop()`` is the same without it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.util import await_only, greenlet_spawn

from .._app import JobQueue
from .._periodic import Scheduler
from ..drivers import driver_class
from ..drivers.base import Driver
from ..errors import ConfigError
from ..leader import Leadership
from .async_executor import AsyncExecutor
from .async_wake import AsyncWake
from .config import WorkerConfig, WorkerSettings, check_pool, takes_settings
from .control import Control
from .maintenance import Maintenance
from .outage import database_key
from .signals import StopSignals, installed_stop_signals, release_stop_signals, stop_signals
from .store import Store
from .vacuum import Vacuumer

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from typing_extensions import Unpack

__all__ = ["AsyncWorker"]

log = logging.getLogger("sqla_jobs.worker")


class AsyncWorker:
    """Runs jobs from ``queue`` using the ``AsyncEngine`` ``engine``; see the module docstring.

    Takes the settings of ``Worker`` (checked by the same ``WorkerConfig``).
    ``concurrency`` is how many jobs run at once: tasks, so it can be far higher
    than a threaded worker's (plain handlers share a pool of that many threads).
    """

    @takes_settings
    def __init__(self, engine: AsyncEngine, queue: JobQueue[Any, Any], **settings: Unpack[WorkerSettings]) -> None:
        self._setup(engine, queue, WorkerConfig.from_settings(**settings))

    @classmethod
    def _from_config(cls, engine: AsyncEngine, queue: JobQueue[Any, Any], config: WorkerConfig) -> AsyncWorker:
        """A worker from settings already checked (the CLI, a supervised process, the bench)."""
        worker = cls.__new__(cls)
        worker._setup(engine, queue, config)
        return worker

    def _setup(self, engine: AsyncEngine, queue: JobQueue[Any, Any], config: WorkerConfig) -> None:
        sync_engine = getattr(engine, "sync_engine", None)
        if sync_engine is None:
            raise ConfigError(f"AsyncWorker takes an AsyncEngine (create_async_engine), got {type(engine).__name__}: "
                              "with an Engine use Worker")
        self.config = config
        self.engine = engine
        self.queue = queue
        self.driver: Driver = queue.driver(sync_engine)
        if config.discards_finished:  # delete at finish what would be pruned at once
            self.driver = self.driver.discarding_finished()
        self.name = config.worker_name
        self._listen = config.listen and self.driver.supports_listen  # asked for, and the database can
        check_pool(sync_engine, config)
        self._store = Store(sync_engine, queue, self.driver, self.name, config.lease, config.queues)
        self._maintenance = Maintenance(None)  # run() elects, unless burst or leader=False
        self._control: Control | None = None
        self._wake: AsyncWake | None = None
        self._stop_asked = False

    @property
    def processed(self) -> int:
        """Outcomes written so far (for tests and the bench)."""
        return self._store.processed

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (from the loop, another thread or a signal handler)."""
        self._stop_asked = True
        if self._control is not None:
            self._control.stopping = True
        if self._wake is not None:
            self._wake.set_threadsafe()

    async def run(self, *, burst: bool = False, install_signals: bool = False) -> int:
        """Process jobs until stopped or cancelled (or, with ``burst``, until no job is due). Returns 0.

        ``install_signals`` (the CLI's): SIGTERM and SIGINT stop the worker
        gracefully, a second one exits at once. Off by default: inside an app,
        its server owns the signals and ends the worker by cancelling it.
        """
        loop = asyncio.get_running_loop()
        self._wake = wake = AsyncWake(loop)
        sync_engine = self._sync_engine()
        executor = AsyncExecutor(self.engine, self.queue, self.driver, self.config.concurrency, self.name,
                                 database_key(self.engine.url), wake, loop, sync_engine=sync_engine,
                                 count_queues=self.config.slots is not None)
        self._control = control = Control(self.config, self._store, executor, wake,  # type: ignore[arg-type]
                                          self._maintenance)
        control.pause = wake.sleep
        control.stopping = self._stop_asked
        had_signals = installed_stop_signals() is not None
        signals = stop_signals() if install_signals else None
        task = loop.create_task(greenlet_spawn(self._run_in_greenlet, burst, executor, signals))
        try:
            try:
                await asyncio.shield(task)  # shielded: a cancellation must not cut the loop mid-write
            except asyncio.CancelledError:
                if not task.done():
                    log.info("worker %s: cancelled, shutting down gracefully", self.name)
                    self.stop()
                    await asyncio.shield(task)  # a second cancellation stops waiting: the leases cover the rest
                raise  # the cancellation goes on once the worker stopped
        finally:
            if signals is not None and not had_signals:
                release_stop_signals()
            if sync_engine is not None:
                sync_engine.dispose()
        log.info("worker %s stopped after %d job attempts", self.name, self.processed)
        return 0

    def _sync_engine(self) -> Engine | None:
        """For plain transactional handlers (they run on threads, which cannot use the loop's connections):
        an engine on the same database through the sync twin of the async driver; None if the app has none."""
        if not any(h.transactional and not h.is_async for h in self.queue.handlers.values()):
            return None
        return self._twin_engine(pool=True)

    def _twin_engine(self, pool: bool) -> Engine:
        """An engine on this worker's database through the sync twin of its async driver, hardened."""
        url, connect_args = driver_class(self.engine.url.get_backend_name()).connect_args(
            self.driver.sync_url(self.engine.url))
        sizing: dict[str, Any] = {"pool_size": self.config.pool_size} if pool else {"poolclass": NullPool}
        engine = create_engine(url, connect_args=connect_args, **sizing)
        self.driver.harden(engine, self.name)
        return engine

    def _run_in_greenlet(self, burst: bool, executor: AsyncExecutor, signals: StopSignals | None) -> None:
        """``Worker.run``'s body: every database call in it is awaited on the loop (see the module docstring)."""
        control = self._control
        assert control is not None
        # Keepalives, timeouts, application_name (see the driver); here, as it closes the idle pooled
        # connections, and an async driver's connection closes only by awaiting.
        self.driver.harden(self._store.engine, self.name)
        self._store.prepare(self._listen, self.config.poll_interval)
        if self.config.leader and not burst:  # a burst worker keeps its own upkeep: it is gone soon
            self._maintenance.leadership = Leadership(self._store.engine, self.queue, self.name,
                                                      lease=self.config.lease)
        if signals is not None:
            signals.attach(f"worker {self.name}", self.stop)
        # The app's periodic jobs, as Worker.run does: the scheduler's thread on a sync twin engine.
        schedule_engine = self._twin_engine(pool=False) if self.queue.schedules and not burst else None
        scheduler = (Scheduler(self.queue, schedule_engine, prune_after=self.config.prune_after)
                     if schedule_engine is not None else None)
        if scheduler is not None:
            scheduler.start()
        # vacuum_dead_rows (sqla_jobs.worker.vacuum): a thread too, on a sync twin engine of its own.
        threshold = self.config.vacuum_dead_rows
        vacuumer = (Vacuumer(self.queue, self._twin_engine(pool=False), threshold, lambda: self._maintenance.acting)
                    if threshold is not None else None)
        if vacuumer is not None:
            vacuumer.start()
        # LISTEN (PostgreSQL): a task on this loop, on a connection out of the worker's AsyncEngine; it
        # sets AsyncWake in the loop's own thread (a listener thread would cost a call_soon_threadsafe hop
        # on every pickup).
        listener = (self.driver.async_listener(self.engine, control.wake_from_database, self.name)
                    if self._listen else None)
        if listener is not None:
            listener.start()
        log.info("worker %s started (async): %s", self.name, self.config.summary())
        try:
            control.run(burst)
        finally:
            if scheduler is not None:
                scheduler.stop()  # joins its thread: a blocking wait, but at most one enqueue long
            if schedule_engine is not None:
                schedule_engine.dispose()
            if vacuumer is not None:
                vacuumer.stop()  # a blocking join too: at most one VACUUM long
                vacuumer.engine.dispose()  # the twin engine is its own
            if listener is not None:
                await_only(listener.stop())  # its connection is closed before the engine's pool is
            self._maintenance.resign()  # the next worker takes the upkeep over at once
            self._store.close()
            executor.shutdown()
