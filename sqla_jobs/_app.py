"""The application object, ``JobQueue``: the registry of handlers and hooks plus the admin operations.

::

    queue = JobQueue(Job, DeadJob)

    @queue.handler("send_email")
    def send_email(payload: dict) -> None:
        ...

    @queue.handler("charge", timeout=30, backoff=Backoff(base=10), transactional=True)
    def charge(payload: dict) -> None:
        current_job().session.add(Payment(...))   # commits with the job's completion

    @queue.on("dead_letter")
    def count_dead(event: JobEvent) -> None:
        statsd.incr("jobs.dead_letter", tags=[f"kind:{event.kind}"])

Point a worker at it with ``sqla-jobs worker --app myapp.jobs:queue``. The
variable is called ``queue`` by habit; the object is the *app* (see
docs/glossary.md): a *queue* is the named lane a job is in.

The class is two halves with one job each: ``_registry.Registry`` (handlers,
hooks, retry policy, the enqueue-time ``check_job``; no database) and
``_admin.Admin`` (enqueue_many, stats, cancel, requeue_dead, prune, ...; each
a call to the driver), whose async forms ``queue.aio`` (``_aio.AsyncAdmin``) runs
on an ``AsyncSession``. This module joins them and owns what both need: the
two models and the driver per database.

While an app with handlers exists for a model, adding a ``Job`` whose kind
has no handler fails at flush with the list of known kinds, so a typo never
reaches the table: the model calls ``check_job`` of each app made for it.
Pass ``check_kinds=False`` when the process that enqueues does not import the
handlers.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection, Engine

from ._admin import Admin
from ._async_admin import AsyncAdmin
from ._backoff import Backoff
from ._batch_admin import BatchAdmin
from ._fair import FairQueue, key_filler, make_fair
from ._fields import add_enqueue_check
from ._graph import register_tables
from ._models import DeadJobMixin, JobMixin
from ._registry import EVENTS, Handler, JobEvent, Registry
from .drivers import Driver, driver_for
from .errors import ConfigError

__all__ = ["EVENTS", "Handler", "JobEvent", "JobQueue"]

J = TypeVar("J", bound=JobMixin)
D = TypeVar("D", bound=DeadJobMixin)


class JobQueue(Registry, Admin[J], BatchAdmin, Generic[J, D]):
    """The app: handlers and hooks for one jobs table and its dead-letter table, and the admin operations on them."""

    def __init__(
        self,
        job_model: type[J],
        dead_model: type[D],
        *,
        backoff: Backoff | None = None,
        check_kinds: bool = True,
        fair: Mapping[str, FairQueue | Mapping[str, int] | None] | Iterable[str] | None = None,
    ) -> None:
        if not (isinstance(job_model, type) and issubclass(job_model, JobMixin)):
            raise ConfigError(f"JobQueue's first argument must be a JobMixin model, got {job_model!r}")
        if not (isinstance(dead_model, type) and issubclass(dead_model, DeadJobMixin)):
            raise ConfigError(f"JobQueue's second argument must be a DeadJobMixin model, got {dead_model!r}")
        super().__init__(backoff=backoff, check_kinds=check_kinds)
        self.job_model = job_model
        self.dead_model = dead_model
        self._drivers: dict[type[Any], Driver] = {}
        self._aio: AsyncAdmin[J] = AsyncAdmin(self)
        add_enqueue_check(job_model, self.check_job)
        #: Fair queues (sqla_jobs._fair): their claim takes the keys in turn; every other queue's is unchanged.
        self.fair = make_fair(fair)
        #: Copies a fair queue's ``key_field`` into ``fair_key`` at flush and in ``enqueue_many`` (None: none has one).
        self._fill_key = key_filler(self.fair)
        if self._fill_key is not None:
            add_enqueue_check(job_model, self._fill_key)
        register_tables(job_model.__table__, dead_model.__table__)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"<JobQueue {self.job_model.__name__}/{self.dead_model.__name__} kinds={sorted(self.handlers)}>"

    @property
    def aio(self) -> AsyncAdmin[J]:
        """The operations for asyncio apps: ``await queue.aio.enqueue_many(async_session, ...)`` and the rest.

        Same methods, results and errors as the sync ones, on an ``AsyncSession``
        (``sqla-jobs[asyncio]``; see docs/howto/asyncio.md).
        """
        return self._aio

    def driver(self, bind: Engine | Connection) -> Driver:
        """The database driver for this app's tables on ``bind``'s database (internal: see sqla_jobs.drivers)."""
        key = type(bind.dialect)
        if key not in self._drivers:
            self._drivers[key] = driver_for(bind, self.job_model.__table__, self.dead_model.__table__)  # type: ignore[attr-defined]
        return self._drivers[key]

    def dashboard(self, engine: Engine, **options: Any) -> Any:
        """The web dashboard for this app, an ASGI app to mount (``sqla-jobs[web]``; see sqla_jobs.web)."""
        # The web package sits above the app (it is written against the operations half, _admin.Admin, and
        # never imports this module), and the app may import only the drivers (tests/test_structure.py,
        # LAYERS): so this convenience loads it by name when asked for, which also keeps Starlette (an
        # extra) out of every process that never serves the dashboard. sqla_jobs.web.dashboard(engine,
        # queue) is the documented way; this method stays for the code that calls it.
        web = importlib.import_module("sqla_jobs.web")
        return web.dashboard(engine, self, **options)
