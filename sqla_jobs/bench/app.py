"""The app ``sqla-jobs bench`` measures: its own models, queue and no-op handlers.

Its tables live in the bench's scratch schema or file (``sqla_jobs.bench.run.scratch``),
never in yours. ``BenchOrder`` is the business row of the enqueue-inside-a-request
figure, and ``PlainJob`` the jobs table mapped bare, the floor of ``add_all``
(``sqla_jobs.bench.enqueue``). ``next`` and ``async_next`` add the next link of a chain in the
transaction that finishes the current one: the chain without ``depends_on`` that ``bench --graphs``
measures beside one with it (``sqla_jobs.bench.graphs``). Worker processes load the app as
``sqla_jobs.bench.run:queue`` (re-exported there) or ``sqla_jobs.bench.app:queue``. ``steps10`` and
``await`` are the durable jobs of ``bench --durable`` (``sqla_jobs.bench.durable``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import Integer, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, registry

from .._app import JobQueue
from .._backoff import Backoff
from .._context import current_job
from .._models import DeadJobMixin, JobMixin

__all__ = ["BenchDeadJob", "BenchJob", "BenchOrder", "PlainJob", "picked_event", "picked_up", "queue"]


class _Base(DeclarativeBase):
    metadata = MetaData()


class BenchJob(JobMixin, _Base):
    __tablename__ = "jobs"


class BenchDeadJob(DeadJobMixin, _Base):
    __tablename__ = "dead_jobs"


class BenchOrder(_Base):
    """The business row of the enqueue-inside-a-request figure."""

    __tablename__ = "bench_orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    note: Mapped[str] = mapped_column(String(64))


class PlainJob:
    """The floor of ``add_all``: the jobs table mapped bare, as an app without sqla-jobs' model would."""

    def __init__(self, **fields: Any) -> None:
        for key, value in fields.items():
            setattr(self, key, value)


registry().map_imperatively(PlainJob, BenchJob.__table__)

queue: JobQueue[BenchJob, BenchDeadJob] = JobQueue(BenchJob, BenchDeadJob, backoff=Backoff(base=0))
picked_up: dict[int, float] = {}
picked_event = threading.Event()


@queue.handler("noop")
def noop(payload: dict[str, Any]) -> None:
    pass


@queue.handler("ping")
def ping(payload: dict[str, Any]) -> None:
    picked_up[payload["n"]] = time.perf_counter()
    picked_event.set()


@queue.handler("async_noop")
async def async_noop(payload: dict[str, Any]) -> None:
    pass


@queue.handler("async_ping")
async def async_ping(payload: dict[str, Any]) -> None:
    picked_up[payload["n"]] = time.perf_counter()
    picked_event.set()


@queue.handler("next", transactional=True)
def enqueue_next(payload: dict[str, Any]) -> None:
    """A link of a chain made without ``depends_on``: the next link commits with this one's finish."""
    if payload["left"] > 1:
        session = current_job().session
        assert session is not None
        session.add(BenchJob(kind="next", payload={"left": payload["left"] - 1}))


@queue.handler("async_next", transactional=True)
async def async_enqueue_next(payload: dict[str, Any]) -> None:
    if payload["left"] > 1:
        session = current_job().session
        assert session is not None
        session.add(BenchJob(kind="async_next", payload={"left": payload["left"] - 1}))


def _same(value: Any) -> Any:
    return value


@queue.handler("steps10")
def steps10(payload: dict[str, Any]) -> list[float]:
    """Ten no-op steps (``bench --durable``): what each ``step`` call took, in ms, is the job's result."""
    job = current_job()
    took = []
    for i in range(10):
        start = time.perf_counter()
        job.step(f"s{i}", _same, i)
        took.append((time.perf_counter() - start) * 1000)
    return took


@queue.handler("await")
def await_event(payload: dict[str, Any]) -> Any:
    """Parks until its own event (``bench --durable``)."""
    return current_job().wait_for_event(payload["key"], timeout=3600)
