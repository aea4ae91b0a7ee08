"""Durable jobs: checkpointed steps, durable sleep, and waiting for an event (docs/howto/durable.md).

A handler made of steps keeps each step's return value; when the job runs again (a retry, a
worker that died, a sleep that ended) the handler runs from the top and each finished step
returns its stored value without being called::

    @queue.handler("fulfil_order")
    def fulfil(payload):
        job = current_job()
        job.step("charge", charge_card, payload["order"])       # runs once; its value is kept
        paid = job.wait_for_event(f"paid:{payload['order']}", timeout=timedelta(days=3))
        if paid is None:                                          # 3 days and no payment
            return job.step("cancel", cancel_order, payload["order"])
        job.sleep(timedelta(hours=24))                            # parks the job for a day
        job.step("remind", send_reminder, payload["order"])

    # elsewhere, in the transaction that records the payment:
    queue.emit_event(session, f"paid:{order_id}", {"amount": 42})

* ``step(name, fn, *args, **kwargs)``: the value is checked by the payload rules (JSON, at
  most ``max_result_bytes``) and stored under (job, ``name``); the step returns the stored copy
  (decoded JSON), the same on the first run and on every re-run. In a ``transactional=True``
  handler the value is written through ``current_job().session``: it commits with the step's
  own writes, exactly once. A step that raises fails the run as any error does (the job's
  retry policy); the steps finished before it are kept.
* ``sleep(duration)`` / ``sleep_until(when)``: the run ends (``JobParked``, a BaseException:
  let it through) and the job is ``pending`` with ``run_at`` at the due time: it holds no
  thread and no connection, uses no attempt, and any worker resumes it. The re-run passes the
  sleep once its due time has come.
* ``wait_for_event(key, timeout)``: the event's data if ``key`` was emitted (before or while
  waiting), or None once ``timeout`` has passed without it; parks the job meanwhile.
  ``queue.emit_event(session, key, data)`` (``queue.aio.emit_event`` for an AsyncSession) stores
  the event in the caller's transaction and makes the jobs waiting for it due at its commit;
  the first emit of a key wins, later ones change nothing. ``queue.emit_events(session, {key:
  data, ...})`` does the same for many events in a few statements. Emitted events are kept until
  ``queue.prune`` removes those older than its age.

Sleeps and waits are steps too (named ``sleep:1``, ``sleep:2`` ... in the order a run reaches
them, and ``event:<key>``; pass ``name=`` to choose), so a re-run passes the ones already
passed with the same result. Names are the identity of the steps: a name used twice in one run
is refused (``ValueError``). ``async def`` handlers have the awaitable twins ``step_async``,
``sleep_async``, ``sleep_until_async``, ``wait_for_event_async``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from ._payload import encode_value
from .drivers._durable import MAX_EVENT_KEY, MAX_STEP_NAME
from .errors import InvalidJob, JobParked

if TYPE_CHECKING:
    from .drivers import Driver

#: A run's ``JobContext`` (``sqla_jobs._context``, which imports this module: typed loosely here, no cycle).
RunContext = Any

__all__ = ["DurableStore", "emit_events", "step", "step_async", "wait_for_event", "wait_for_event_async"]


class DurableStore(Protocol):
    """What a worker gives a run for its steps (``JobContext._durable``: ``sqla_jobs.worker.steps``)."""

    driver: Driver
    step_limit: int
    kinds: set[str]  # the kinds whose runs read their steps: a worker reads theirs with the claim (``prefetch``)
    tracing: Any  # the app's (``sqla_jobs.otel``): each step, sleep and wait a span; None: off

    def read(self, action: Callable[[Connection], Any]) -> Any: ...
    def write(self, action: Callable[[Connection], Any]) -> Any: ...
    async def read_async(self, action: Callable[[Connection], Any]) -> Any: ...
    async def write_async(self, action: Callable[[Connection], Any]) -> Any: ...


@dataclass
class Book:
    """One run's view of its job's steps, read once at its first step, sleep or wait."""

    rows: dict[str, Any]
    seen: set[str] = field(default_factory=set)
    sleeps: int = 0


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _seconds(duration: timedelta | float, what: str) -> timedelta:
    if isinstance(duration, timedelta):
        return duration
    if isinstance(duration, (int, float)) and not isinstance(duration, bool):
        return timedelta(seconds=duration)
    raise TypeError(f"{what} takes a timedelta or a number of seconds, not {type(duration).__name__}")


def check_name(name: Any, what: str = "step name") -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME:
        raise ValueError(f"a {what} is a non-empty string of at most {MAX_STEP_NAME} characters, not {name!r}")
    return name


def check_key(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_EVENT_KEY:
        raise InvalidJob(f"an event key is a non-empty string of at most {MAX_EVENT_KEY} characters, not {key!r}")
    return key


def _store(ctx: RunContext) -> DurableStore:
    if ctx._durable is None:
        raise LookupError("steps, sleeps and waits need a job run by a sqla-jobs worker")
    return ctx._durable  # type: ignore[no-any-return]


def _claim(ctx: RunContext, book: Book, name: str) -> Any:
    """The stored row of ``name`` (None if never reached), after checking the name is new in this run."""
    if name in book.seen:
        raise ValueError(f"step name {name!r} is used twice in this run of job {ctx.id}: a step's name is its "
                         "identity, give each step its own")
    book.seen.add(name)
    return book.rows.get(name)


def _book(ctx: RunContext) -> Book:
    if ctx._book is None:
        store = _store(ctx)
        rows = store.read(lambda conn: store.driver.job_steps(conn, ctx.id))
        ctx._book = Book({row.name: row for row in rows})
        store.kinds.add(ctx.kind)
    return ctx._book  # type: ignore[no-any-return]


async def _book_async(ctx: RunContext) -> Book:
    if ctx._book is None:
        store = _store(ctx)
        rows = await store.read_async(lambda conn: store.driver.job_steps(conn, ctx.id))
        ctx._book = Book({row.name: row for row in rows})
        store.kinds.add(ctx.kind)
    return ctx._book  # type: ignore[no-any-return]


def _checked(ctx: RunContext, value: Any, name: str) -> Any:
    return json.loads(encode_value(value, _store(ctx).step_limit, f"the value of step {name!r}"))


def _saver(ctx: RunContext, name: str, value: Any, started: datetime) -> Callable[[Connection], None]:
    store = _store(ctx)
    return lambda conn: store.driver.save_step(conn, ctx.id, name, value, started, utcnow())


def _save(ctx: RunContext, name: str, value: Any, started: datetime) -> Any:
    """Store a finished step: through the transactional handler's session, else in a transaction of its own."""
    action = _saver(ctx, name, value, started)
    if isinstance(ctx.session, Session):
        action(ctx.session.connection())
    else:
        _store(ctx).write(action)
    return value


async def _save_async(ctx: RunContext, name: str, value: Any, started: datetime) -> Any:
    action = _saver(ctx, name, value, started)
    session = ctx.session
    if isinstance(session, Session):
        action(session.connection())
    elif session is not None:  # an AsyncSession: the async transactional handler's
        await session.run_sync(lambda s: action(s.connection()))  # type: ignore[unreachable]
    else:
        await _store(ctx).write_async(action)
    return value


# -- steps -------------------------------------------------------------------------------------


def _span(ctx: RunContext, what: str, name: str, **attributes: Any) -> Any:
    """The span of a step, sleep or wait when the app is traced (``sqla_jobs.otel``); a no-op otherwise."""
    tracing = _store(ctx).tracing
    return nullcontext(None) if tracing is None else tracing.step(what, name, attributes)


def _outcome(span: Any, outcome: str) -> None:
    if span is not None:
        span.set_attribute("sqla_jobs.step.outcome", outcome)


def step(ctx: RunContext, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    row = _claim(ctx, _book(ctx), check_name(name))
    with _span(ctx, "step", name) as span:
        if row is not None and row.finished_at is not None:
            _outcome(span, "replayed")
            return row.value
        started = utcnow()
        value = _save(ctx, name, _checked(ctx, fn(*args, **kwargs), name), started)
        _outcome(span, "ran")
        return value


async def step_async(ctx: RunContext, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    row = _claim(ctx, await _book_async(ctx), check_name(name))
    with _span(ctx, "step", name) as span:
        if row is not None and row.finished_at is not None:
            _outcome(span, "replayed")
            return row.value
        started = utcnow()
        value = fn(*args, **kwargs)
        if inspect.isawaitable(value):
            value = await value
        value = await _save_async(ctx, name, _checked(ctx, value, name), started)
        _outcome(span, "ran")
        return value


# -- sleeps and waits --------------------------------------------------------------------------


@dataclass(frozen=True)
class Stop:
    """Where a run reached a sleep or a wait: its ``name``, what it waits for (``key`` or None), and its due
    time ``until`` the first time (the stored one after)."""

    name: str
    until: datetime
    key: str | None = None


def sleep_stop(ctx: RunContext, book: Book, due: Callable[[datetime], datetime], name: str | None) -> Stop:
    book.sleeps += 1
    name = check_name(name or f"sleep:{book.sleeps}", "sleep name")
    return Stop(name, due(utcnow()))


def wait_stop(key: str, timeout: timedelta | float, name: str | None) -> Stop:
    key, span = check_key(key), _seconds(timeout, "wait_for_event's timeout")
    return Stop(check_name(name or f"event:{key}", "wait name"), utcnow() + span, key)


def _decide(row: Any, stop: Stop, event: Any) -> tuple[str, Any]:
    """What a run does at ``stop`` (its stored ``row``, the emitted ``event`` if any):
    ("passed", value) to return a stored value, ("save", value) to store and return it, or ("park", until)."""
    if row is not None and row.finished_at is not None:
        return "passed", row.value
    if event is not None:
        return "save", event.data
    until = _aware(row.until) if row is not None and row.until is not None else stop.until
    if until <= utcnow():
        return "save", None
    return "park", until


def _act(ctx: RunContext, stop: Stop, verdict: tuple[str, Any], event: Any, span: Any) -> tuple[bool, Any]:
    how, value = verdict
    if how == "park":
        _outcome(span, "parked")
        if span is not None:
            span.set_attribute("sqla_jobs.step.until", value.isoformat())
        raise JobParked(stop.name, value, utcnow(), stop.key)
    _outcome(span, "passed" if how == "passed" else "event" if event is not None else
             "timed out" if stop.key is not None else "woke")
    return how == "save", value


def _stop_span(ctx: RunContext, stop: Stop) -> Any:
    if stop.key is None:
        return _span(ctx, "sleep", stop.name)
    return _span(ctx, "wait", stop.key, **{"sqla_jobs.event.key": stop.key})


def pass_stop(ctx: RunContext, stop: Stop) -> Any:
    store = _store(ctx)
    row = _claim(ctx, _book(ctx), stop.name)
    with _stop_span(ctx, stop) as span:
        event = None
        if stop.key is not None and (row is None or row.finished_at is None):
            event = store.read(lambda conn: store.driver.event(conn, stop.key))
        save, value = _act(ctx, stop, _decide(row, stop, event), event, span)
        return _save(ctx, stop.name, value, utcnow()) if save else value


async def pass_stop_async(ctx: RunContext, stop: Stop) -> Any:
    store = _store(ctx)
    row = _claim(ctx, await _book_async(ctx), stop.name)
    with _stop_span(ctx, stop) as span:
        event = None
        if stop.key is not None and (row is None or row.finished_at is None):
            event = await store.read_async(lambda conn: store.driver.event(conn, stop.key))
        save, value = _act(ctx, stop, _decide(row, stop, event), event, span)
        return await _save_async(ctx, stop.name, value, utcnow()) if save else value


def sleep(ctx: RunContext, duration: timedelta | float, name: str | None) -> None:
    span = _seconds(duration, "sleep")
    pass_stop(ctx, sleep_stop(ctx, _book(ctx), lambda now: now + span, name))


def sleep_until(ctx: RunContext, when: datetime, name: str | None) -> None:
    pass_stop(ctx, sleep_stop(ctx, _book(ctx), lambda now: _aware(when), name))


async def sleep_async(ctx: RunContext, duration: timedelta | float, name: str | None) -> None:
    span = _seconds(duration, "sleep")
    await pass_stop_async(ctx, sleep_stop(ctx, await _book_async(ctx), lambda now: now + span, name))


async def sleep_until_async(ctx: RunContext, when: datetime, name: str | None) -> None:
    await pass_stop_async(ctx, sleep_stop(ctx, await _book_async(ctx), lambda now: _aware(when), name))


def wait_for_event(ctx: RunContext, key: str, timeout: timedelta | float, name: str | None) -> Any:
    return pass_stop(ctx, wait_stop(key, timeout, name))


async def wait_for_event_async(ctx: RunContext, key: str, timeout: timedelta | float, name: str | None) -> Any:
    return await pass_stop_async(ctx, wait_stop(key, timeout, name))


# -- emitting ----------------------------------------------------------------------------------


def emit_events(driver: Driver, conn: Connection, events: Mapping[str, Any] | Iterable[tuple[str, Any]],
                limit: int) -> tuple[set[str], int]:
    """Store ``events`` in ``conn``'s transaction (see ``JobQueue.emit_events``): every key and data checked before
    anything is written, the first of a key given twice kept. The keys emitted, and how many parked jobs they woke."""
    first: dict[str, Any] = {}
    for item in events.items() if isinstance(events, Mapping) else events:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(f"events are a mapping of key to data, or (key, data) pairs: not {item!r}")
        key = check_key(item[0])
        first.setdefault(key, json.loads(encode_value(item[1], limit, f"the data of event {key!r}")))
    return driver.emit_many(conn, first) if first else (set(), 0)
