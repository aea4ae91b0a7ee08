"""``queue.aio``: the enqueue and admin operations for asyncio apps, on SQLAlchemy's ``AsyncSession``.

::

    async with async_session.begin():
        async_session.add(Order(...))
        await queue.aio.enqueue_many(async_session, [{"kind": "send_email", "payload": {...}}])

Each method is the sync method of ``sqla_jobs._admin.Admin`` run through
``AsyncSession.run_sync`` (or ``AsyncConnection.run_sync``): SQLAlchemy hands
it the ``Session`` (or ``Connection``) behind the async one, on the same
connection and in the same transaction, and every statement it runs is
awaited on the async driver. So there is one code path for the SQL, still in
the drivers, whichever flavour calls it; the only async-specific statement is
PostgreSQL's COPY, which the driver awaits on psycopg's async connection.

Nothing is committed here: the caller's ``async with session.begin()`` (or
``await session.commit()``) decides, exactly as with the sync methods.
See docs/howto/asyncio.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sqlalchemy.orm import Session

from ._models import JobMixin
from ._stats import QueueStats
from ._unique import Enqueued
from .errors import ConfigError

if TYPE_CHECKING:
    # Imported when used, not here: SQLAlchemy's asyncio module needs greenlet (the asyncio extra),
    # and an app that never touches queue.aio must import sqla_jobs without it.
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    from ._admin import Admin

__all__ = ["AsyncAdmin"]

J = TypeVar("J", bound=JobMixin)
R = TypeVar("R")


class AsyncAdmin(Generic[J]):
    """The async forms of the app's operations; reach it as ``queue.aio`` (one per app).

    Every method takes an ``AsyncSession`` where the sync one takes a
    ``Session`` (``stats`` also an ``AsyncEngine`` or ``AsyncConnection``),
    returns the same result and raises the same errors.
    """

    def __init__(self, admin: Admin[J]) -> None:
        self._admin = admin

    def __repr__(self) -> str:
        return f"<AsyncAdmin of {self._admin!r}>"

    # -- enqueue, in the caller's transaction ----------------------------------------

    async def enqueue(
        self, session: AsyncSession, kind: str, payload: dict[str, Any] | None = None, **fields: Any
    ) -> J:
        """``queue.enqueue`` on an ``AsyncSession``: adds the job (``unique_key=``: see ``enqueue_unique``)."""
        return await _run(session, "enqueue", partial(self._admin.enqueue, kind=kind, payload=payload, **fields))

    async def enqueue_unique(
        self,
        session: AsyncSession,
        kind: str,
        payload: dict[str, Any] | None = None,
        *,
        unique_key: str,
        unique_states: Sequence[str] | None = None,
        unique_period: float | None = None,
        **fields: Any,
    ) -> Enqueued[J]:
        """``queue.enqueue_unique`` on an ``AsyncSession``: the new job, or the one holding the key."""
        call = partial(self._admin.enqueue_unique, kind=kind, payload=payload, unique_key=unique_key,
                       unique_states=unique_states, unique_period=unique_period, **fields)
        return await _run(session, "enqueue_unique", call)

    async def enqueue_many(self, session: AsyncSession, jobs: Iterable[Mapping[str, Any]], *,
                           batch: Any = None) -> int:
        """``queue.enqueue_many`` on an ``AsyncSession`` (COPY on PostgreSQL); returns how many were inserted."""
        return await _run(session, "enqueue_many", partial(self._admin.enqueue_many, jobs=jobs, batch=batch))

    # -- reads -------------------------------------------------------------------

    async def stats(
        self, bind: AsyncSession | AsyncEngine | AsyncConnection, *, window: float = 3600.0, run_times: bool = True
    ) -> QueueStats:
        """``queue.stats`` on an ``AsyncSession``, ``AsyncConnection`` or ``AsyncEngine``."""
        call = partial(self._admin.stats, window=window, run_times=run_times)
        connection_class, engine_class, _ = _asyncio_classes()
        if isinstance(bind, engine_class):
            async with bind.connect() as conn:
                return await conn.run_sync(call)
        if isinstance(bind, connection_class):
            return await bind.run_sync(call)
        return await _run(bind, "stats", call)

    async def get_job(self, session: AsyncSession, job_id: int) -> Any:
        """``queue.get_job``: the job's row, or None."""
        return await _run(session, "get_job", partial(self._admin.get_job, job_id=job_id))

    async def batch(self, session: AsyncSession, batch_id: int) -> Any:
        """``queue.batch``: how a batch stands (``BatchStatus``), or None."""
        return await _run(session, "batch", partial(self._admin.batch, batch_id=batch_id))  # type: ignore[attr-defined]

    async def batches(self, session: AsyncSession, *, limit: int = 50, before: int | None = None) -> Any:
        """``queue.batches``: the newest batches (``BatchSummary``)."""
        return await _run(session, "batches", partial(self._admin.batches, limit=limit, before=before))  # type: ignore[attr-defined]

    async def get_dead(self, session: AsyncSession, job_id: int) -> Any:
        """``queue.get_dead``: the dead job's row, or None."""
        return await _run(session, "get_dead", partial(self._admin.get_dead, job_id=job_id))

    async def list_jobs(
        self,
        session: AsyncSession,
        *,
        kind: str | None = None,
        state: str | None = None,
        queue: str | None = None,
        unique_key: str | None = None,
        limit: int = 50,
    ) -> list[Any]:
        """``queue.list_jobs``: jobs newest first, filtered as there."""
        call = partial(self._admin.list_jobs, kind=kind, state=state, queue=queue, unique_key=unique_key, limit=limit)
        return await _run(session, "list_jobs", call)

    async def list_dead(
        self, session: AsyncSession, *, kind: str | None = None, since: float | None = None, limit: int = 50
    ) -> list[Any]:
        """``queue.list_dead``: dead jobs, latest failure first."""
        return await _run(session, "list_dead", partial(self._admin.list_dead, kind=kind, since=since, limit=limit))

    # -- changes, in the caller's transaction -------------------------------------------

    async def cancel(self, session: AsyncSession, job_id: int) -> str:
        """``queue.cancel``: ``"cancelled"`` (it was pending) or ``"requested"`` (it is running)."""
        return await _run(session, "cancel", partial(self._admin.cancel, job_id=job_id))

    async def emit_event(self, session: AsyncSession, key: str, data: Any = None) -> int | None:
        """``queue.emit_event``: emit event ``key`` in the caller's transaction (None: it was emitted before)."""
        return await _run(session, "emit_event", partial(self._admin.emit_event, key=key, data=data))

    async def emit_events(self, session: AsyncSession, events: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> int:
        """``queue.emit_events``: emit many events in the caller's transaction; how many parked jobs they made due."""
        return await _run(session, "emit_events", partial(self._admin.emit_events, events=events))

    async def job_steps(self, session: AsyncSession, job_id: int) -> list[Any]:
        """``queue.job_steps``: a job's steps, sleeps and waits as stored."""
        return await _run(session, "job_steps", partial(self._admin.job_steps, job_id=job_id))

    async def retry_now(self, session: AsyncSession, job_id: int) -> None:
        """``queue.retry_now``: make a pending job due now."""
        await _run(session, "retry_now", partial(self._admin.retry_now, job_id=job_id))

    async def requeue_dead(
        self, session: AsyncSession, *, ids: list[int] | None = None, kind: str | None = None, everything: bool = False
    ) -> list[int]:
        """``queue.requeue_dead``: move dead jobs back; returns the ids moved."""
        call = partial(self._admin.requeue_dead, ids=ids, kind=kind, everything=everything)
        return await _run(session, "requeue_dead", call)

    async def purge_dead(self, session: AsyncSession, *, older_than: float, kind: str | None = None) -> int:
        """``queue.purge_dead``: delete old dead jobs; returns how many."""
        return await _run(session, "purge_dead", partial(self._admin.purge_dead, older_than=older_than, kind=kind))

    # -- tables --------------------------------------------------------------------

    async def create_tables(self, engine: AsyncEngine) -> None:
        """``queue.create_tables`` on an ``AsyncEngine``: the two tables and their indexes, if missing."""
        async with _engine(engine, "create_tables").begin() as conn:
            await conn.run_sync(self._admin._create_tables_on)

    async def check_schema(self, engine: AsyncEngine) -> None:
        """``queue.check_schema`` on an ``AsyncEngine``: ``SchemaError`` saying what to run, when out of date."""
        async with _engine(engine, "check_schema").connect() as conn:
            await conn.run_sync(self._admin._check_schema_on)


def _asyncio_classes() -> tuple[type[AsyncConnection], type[AsyncEngine], type[AsyncSession]]:
    try:
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    except ImportError as exc:  # greenlet missing
        raise ConfigError(f"queue.aio needs SQLAlchemy's asyncio support: pip install 'sqla-jobs[asyncio]' ({exc})")
    return AsyncConnection, AsyncEngine, AsyncSession


async def _run(session: AsyncSession, name: str, call: Callable[[Session], R]) -> R:
    if not isinstance(session, _asyncio_classes()[2]):
        hint = (f"with a Session call queue.{name}(session, ...) instead" if isinstance(session, Session)
                else "open one with AsyncSession(async_engine) or an async_sessionmaker")
        raise ConfigError(f"queue.aio.{name} takes an AsyncSession, got {type(session).__name__}: {hint}")
    return await session.run_sync(call)


def _engine(engine: AsyncEngine, name: str) -> AsyncEngine:
    if not isinstance(engine, _asyncio_classes()[1]):
        raise ConfigError(f"queue.aio.{name} takes an AsyncEngine, got {type(engine).__name__}: "
                          f"with an Engine call queue.{name}(engine) instead")
    return engine
