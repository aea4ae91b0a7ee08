"""The app's registry half: which handler runs which kind, the hooks, the retry policy, the enqueue check.

``JobQueue`` (``sqla_jobs._app``) is this registry plus the admin operations
of ``sqla_jobs._admin``. Nothing here touches the database: the worker asks
it what to run (``handlers``), how long to wait before a retry
(``retry_delay``) and whom to tell (``listens``/``emit``); the model asks it
whether a new job may be written (``check_job``).

Events (``app.on(name)``): ``started``, ``finished``, ``failed`` (a retry is
scheduled), ``dead_letter``, ``cancelled``, ``snoozed``, ``lost`` (the worker
lost its claim and discarded the result). A hook that raises is logged and
ignored: it never fails a job.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta, tzinfo
from typing import Any, TypeVar

from ._backoff import Backoff
from ._limits import KindLimit, make_limit
from ._periodic import Schedule, make_schedule
from ._typed import PayloadSchema, declared_payload_type
from .errors import ConfigError, InvalidJob

__all__ = ["EVENTS", "Handler", "JobEvent", "Registry"]

log = logging.getLogger("sqla_jobs")

EVENTS = ("started", "finished", "failed", "dead_letter", "cancelled", "snoozed", "lost")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Handler:
    """A registered handler and its per-kind options."""

    kind: str
    fn: Callable[..., Any]
    timeout: float | None
    backoff: Backoff | None
    transactional: bool
    is_async: bool
    #: The payload's declared type (``sqla_jobs._typed``); ``fn`` then converts the payload before the call.
    payload: PayloadSchema | None = None
    #: Its limits across all workers (``limit``, ``limit_key``, ``rate``; see ``sqla_jobs._limits``).
    limits: KindLimit | None = None


@dataclass(frozen=True)
class JobEvent:
    """What a hook is told. ``duration`` (seconds) and ``error`` are set when known."""

    name: str
    id: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    duration: float | None = None
    error: str | None = None


class Registry:
    """Handlers by kind, hooks by event, the default backoff and the enqueue-time check."""

    def __init__(self, *, backoff: Backoff | None = None, check_kinds: bool = True) -> None:
        self.backoff = backoff or Backoff()
        self.check_kinds = check_kinds
        #: Set by ``sqla_jobs.otel.instrument`` (None: tracing off): stamps new jobs with the caller's trace
        #: context, and the worker runs each job in a span (``run``, ``run_async``).
        self.tracing: Any = None
        self.handlers: dict[str, Handler] = {}
        #: Periodic jobs by name (``periodic``); every worker of this app enqueues their slots.
        self.schedules: dict[str, Schedule] = {}
        self._hooks: dict[str, list[Callable[[JobEvent], Any]]] = {name: [] for name in EVENTS}

    # -- handlers ----------------------------------------------------------------

    def handler(
        self,
        kind: str,
        *,
        timeout: float | None = None,
        backoff: Backoff | None = None,
        transactional: bool = False,
        payload_type: Any = None,
        limit: int | None = None,
        limit_key: str | None = None,
        rate: tuple[int, float] | None = None,
    ) -> Callable[[F], F]:
        """Register ``fn(payload)`` as the handler of ``kind``.

        ``timeout`` (seconds): a run that takes longer counts as failed and its
        late result is discarded. ``backoff`` overrides the app's retry
        delays for this kind. ``transactional``: see ``current_job().session``.
        ``async def`` handlers are run on an event loop in the worker thread
        (``AsyncWorker``: on its own event loop); an ``async def`` handler can be
        ``transactional`` only under ``AsyncWorker`` (its session is an ``AsyncSession``).
        ``payload_type``: a dataclass, ``TypedDict`` or pydantic model the
        payload must fit, checked at enqueue and handed to ``fn`` as that
        type; by default the type ``fn``'s first parameter is annotated with,
        if it is one of those (see ``sqla_jobs._typed``).
        """
        if not isinstance(kind, str) or not kind.strip():
            raise ConfigError(f"handler kind must be a non-empty string, got {kind!r}")
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"handler {kind!r}: timeout must be > 0 seconds")
        limits = make_limit(kind, limit, limit_key, rate)

        def register(fn: F) -> F:
            if kind in self.handlers:
                raise ConfigError(f"kind {kind!r} already has a handler: {self.handlers[kind].fn!r}")
            is_async = inspect.iscoroutinefunction(fn)
            declared = payload_type if payload_type is not None else declared_payload_type(fn)
            schema = PayloadSchema(kind, declared) if declared is not None else None
            call = _typed_call(fn, schema, is_async) if schema is not None else fn
            self.handlers[kind] = Handler(kind, call, timeout, backoff, transactional, is_async, schema, limits)
            return fn

        return register

    def periodic(
        self,
        cron: str | None = None,
        *,
        every: float | timedelta | None = None,
        kind: str,
        payload: dict[str, Any] | None = None,
        tz: str | tzinfo | None = None,
        name: str | None = None,
        missed: str = "once",
        catch_up: float = 86400.0,
        **fields: Any,
    ) -> Callable[[F], F]:
        """Enqueue a ``kind`` job on a schedule: a ``cron`` expression in time zone ``tz``, or ``every`` seconds.

        Registered at once; used as a decorator, the function also becomes
        the handler of ``kind``. Every worker of this app enqueues the due
        slots; the database lets exactly one job per slot in. ``missed``:
        after downtime, ``"once"`` runs the latest missed slot if it is at
        most ``catch_up`` seconds old, ``"skip"`` waits for the next slot.
        ``name`` (default: ``kind``) identifies the schedule in its slots'
        keys: two schedules of one kind need names. ``fields``: ``queue``,
        ``priority``, ``max_attempts`` of the jobs. See docs/howto/periodic-jobs.md.
        """
        schedule = make_schedule(cron, every=every, kind=kind, payload=payload, tz=tz, name=name, missed=missed,
                                 catch_up=catch_up, fields=fields)
        if schedule.name in self.schedules:
            raise ConfigError(f"a periodic schedule named {schedule.name!r} exists already: give this one name=")
        unknown = set(fields) - {"queue", "priority", "max_attempts"}
        if unknown:
            raise ConfigError(f"periodic: unknown job field(s) {', '.join(sorted(unknown))}; "
                              "allowed: queue, priority, max_attempts")
        self.schedules[schedule.name] = schedule

        def register(fn: F) -> F:
            if kind not in self.handlers:
                self.handler(kind)(fn)
            elif fn not in (self.handlers[kind].fn, getattr(self.handlers[kind].fn, "__wrapped__", None)):
                raise ConfigError(f"@periodic(kind={kind!r}) decorates {fn!r}, but the kind's handler is "
                                  f"{self.handlers[kind].fn!r}: decorate that one, or call queue.periodic(...) "
                                  "without decorating")
            return fn

        return register

    def kind_limits(self) -> list[KindLimit]:
        """The limits the worker's claims apply, by kind (empty: the claim has no limit to apply)."""
        return sorted((h.limits for h in self.handlers.values() if h.limits is not None), key=lambda k: k.kind)

    def retry_delay(self, kind: str, failures: int) -> float:
        """Seconds to wait before the next run of a ``kind`` job that has failed ``failures`` times."""
        handler = self.handlers.get(kind)
        policy = handler.backoff if handler and handler.backoff else self.backoff
        return policy.delay(failures)

    def unknown_kind_message(self, kind: str) -> str:
        known = ", ".join(sorted(self.handlers)) or "(none registered)"
        return f"no handler for kind {kind!r}; known kinds: {known}. Register one with @queue.handler({kind!r})"

    # -- the enqueue-time check ----------------------------------------------------

    def check_job(self, job: Any) -> None:
        """Refuse a new job before it is written: raise ``InvalidJob``.

        Called for every job the app's model writes, after the fields are
        checked: at flush for ``session.add(Job(...))`` (``job`` is that
        ``Job``) and for each item of ``enqueue_many`` (``job`` is a view of
        the item with the same attributes: ``kind``, ``queue``, ``payload``,
        ``priority``, ``max_attempts``, ``run_at``). A field the caller did
        not set may be None: the database default applies. The default check
        refuses a kind that has no handler while the app has handlers and
        ``check_kinds`` is true.
        Override it in a subclass to add rules of your own, calling
        ``super().check_job(job)``; it must check, not change, the job.
        """
        kind = job.kind
        handler = self.handlers.get(kind)
        if handler is None:
            if self.check_kinds and self.handlers:
                raise InvalidJob(f"Job.kind: {self.unknown_kind_message(kind)}, or pass check_kinds=False")
        elif handler.payload is not None:
            handler.payload.load({} if job.payload is None else job.payload)

    # -- hooks -------------------------------------------------------------------

    def on(self, event: str) -> Callable[[F], F]:
        """Register a hook ``fn(JobEvent)`` for one of ``EVENTS``."""
        if event not in self._hooks:
            raise ConfigError(f"unknown event {event!r}; choose from {', '.join(EVENTS)}")

        def register(fn: F) -> F:
            self._hooks[event].append(fn)
            return fn

        return register

    def listens(self, event: str) -> bool:
        """Whether any hook is registered for ``event`` (lets the worker skip building events)."""
        return bool(self._hooks[event])

    def off(self, event: str, fn: Callable[[JobEvent], Any]) -> None:
        """Remove a hook added with ``on`` (no error if it is not there)."""
        if fn in self._hooks.get(event, []):
            self._hooks[event].remove(fn)

    def emit(self, event: JobEvent) -> None:
        """Call each hook of ``event.name``; one that raises is logged and skipped."""
        for hook in self._hooks[event.name]:
            try:
                hook(event)
            except Exception:
                log.exception("hook %r for %s raised; ignored", hook, event.name)


def _typed_call(fn: Callable[..., Any], schema: PayloadSchema, is_async: bool) -> Callable[..., Any]:
    """``fn`` called with the payload turned into its declared type (what the worker runs)."""
    if is_async:

        @functools.wraps(fn)
        async def call_async(payload: Any) -> Any:
            return await fn(schema.load(payload))

        return call_async

    @functools.wraps(fn)
    def call(payload: Any) -> Any:
        return fn(schema.load(payload))

    return call
