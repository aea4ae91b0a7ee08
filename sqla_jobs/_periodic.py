"""Periodic jobs: schedules (cron or an interval), their slots, and the thread every worker runs for them.

::

    @queue.periodic("*/5 * * * *", kind="sync_prices", tz="Europe/Paris")
    def sync_prices(payload: dict) -> None: ...

    queue.periodic(every=timedelta(hours=1), kind="purge_sessions")

Every ordinary worker runs the schedules of its app (``Scheduler``, a thread
started by ``Worker.run``); there is no scheduler process. Each *slot* (one
moment a schedule fires) is enqueued with a unique key made of the
schedule's name and the slot's time in UTC (``periodic:<name>@<time>``),
held in every state (pending, running, finished and cancelled): however many
workers try, and however often they restart, the database's unique index lets
one job per slot in (see ``sqla_jobs._unique``). A slot whose job was
dead-lettered is not enqueued again either (the dead-letter table keeps its key).

Missed slots (no worker was up at the slot's time): ``missed="once"`` (the
default) enqueues the latest missed slot once, when it is at most
``catch_up`` seconds old; ``missed="skip"`` enqueues a slot only while it is
fresh (within half the time to the next slot, at most a minute) and
otherwise waits for the next one. Older missed slots never run. A schedule
removed from the code is simply never enqueued again.

Cron expressions are parsed by ``cronsim`` (the ``sqla-jobs[cron]`` extra), in
the time zone given with ``tz`` (required for cron, so 02:30 means what you
meant); intervals count from the Unix epoch in UTC (``every=3600`` fires on
the hour).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ._unique import STATE_BITS
from .errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


class _App(Protocol):
    """What the scheduler uses of the app (a ``JobQueue``): typed here without importing ``_app``,
    which imports the registry, which imports this module."""

    schedules: dict[str, Schedule]
    handlers: Mapping[str, Any]
    check_kinds: bool

    def driver(self, bind: Any) -> Any: ...
    def enqueue_unique(self, session: Session, kind: str, payload: Any = None, **fields: Any) -> Any: ...
    def unknown_kind_message(self, kind: str) -> str: ...

__all__ = ["MISSED_POLICIES", "Schedule", "Scheduler", "enqueue_due", "make_schedule"]

log = logging.getLogger("sqla_jobs.periodic")

MISSED_POLICIES = ("once", "skip")
#: A slot's key is held in every state: a finished (or cancelled) slot is still done.
SLOT_STATES = tuple(STATE_BITS)
#: The longest a worker's scheduler thread sleeps between looks (it wakes at the next slot before that).
MAX_SLEEP = 30.0
_SKIP_FRESHNESS = 60.0


def _cronsim() -> Any:
    try:
        return importlib.import_module("cronsim")
    except ImportError:
        raise ConfigError('cron schedules need the cronsim package: pip install "sqla-jobs[cron]"') from None


@dataclass(frozen=True)
class Schedule:
    """One periodic job: what to enqueue and when. Made by ``JobQueue.periodic``."""

    name: str
    kind: str
    cron: str | None
    every: float | None
    tz: tzinfo
    payload: dict[str, Any] = field(default_factory=dict)
    missed: str = "once"
    catch_up: float = 86400.0
    #: Extra job fields: queue, priority, max_attempts.
    fields: dict[str, Any] = field(default_factory=dict)

    def latest_slot(self, now: datetime) -> datetime:
        """The last slot at or before ``now`` (aware, in UTC)."""
        if self.every is not None:
            moment = now.timestamp()
            return datetime.fromtimestamp(moment - moment % self.every, timezone.utc)
        local = now.astimezone(self.tz).replace(second=0, microsecond=0) + timedelta(minutes=1)
        return next(_cronsim().CronSim(self.cron, local, reverse=True)).astimezone(timezone.utc)  # type: ignore[no-any-return]

    def next_slot(self, now: datetime) -> datetime:
        """The first slot after ``now`` (aware, in UTC)."""
        if self.every is not None:
            return self.latest_slot(now) + timedelta(seconds=self.every)
        return next(_cronsim().CronSim(self.cron, now.astimezone(self.tz))).astimezone(timezone.utc)  # type: ignore[no-any-return]

    def due_slot(self, now: datetime) -> datetime | None:
        """The slot to enqueue at ``now`` under the missed-slot policy, or None (the latest one is too late)."""
        slot = self.latest_slot(now)
        late = (now - slot).total_seconds()
        if self.missed == "skip":
            fresh = min(_SKIP_FRESHNESS, (self.next_slot(now) - slot).total_seconds() / 2)
            return slot if late <= fresh else None
        return slot if late <= self.catch_up else None

    def key(self, slot: datetime) -> str:
        stamp = slot.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        return f"periodic:{self.name}@{stamp}Z"


def _zone(tz: str | tzinfo | None, where: str) -> tzinfo:
    if isinstance(tz, tzinfo):
        return tz
    if not isinstance(tz, str) or not tz:
        raise ConfigError(f"{where}: pass tz= ('UTC' or a zone name such as 'Europe/Paris'): "
                          "the cron fields are read in that time zone")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"{where}: unknown time zone {tz!r}; use an IANA name such as 'UTC' or "
                          "'Europe/Paris' (on Windows, pip install tzdata)") from None


def make_schedule(
    cron: str | None,
    *,
    every: float | timedelta | None,
    kind: str,
    payload: dict[str, Any] | None,
    tz: str | tzinfo | None,
    name: str | None,
    missed: str,
    catch_up: float,
    fields: dict[str, Any],
) -> Schedule:
    """A checked ``Schedule``: ConfigError saying what to pass for each bad argument."""
    where = f"periodic({cron!r})" if cron is not None else f"periodic(every={every!r})"
    if not isinstance(kind, str) or not kind.strip():
        raise ConfigError(f"{where}: kind= must name the handler to run, got {kind!r}")
    if (cron is None) == (every is None):
        raise ConfigError(f"{where}: give either a cron expression or every= (seconds or a timedelta), not "
                          + ("both" if cron is not None else "neither"))
    if missed not in MISSED_POLICIES:
        raise ConfigError(f"{where}: missed= must be one of {', '.join(MISSED_POLICIES)}, got {missed!r}")
    if not isinstance(catch_up, (int, float)) or catch_up < 0:
        raise ConfigError(f"{where}: catch_up= must be >= 0 seconds, got {catch_up!r}")
    seconds: float | None = None
    zone: tzinfo = timezone.utc
    if every is not None:
        seconds = every.total_seconds() if isinstance(every, timedelta) else every
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 1:
            raise ConfigError(f"{where}: every= must be at least 1 second, got {every!r}")
        if tz is not None:
            raise ConfigError(f"{where}: tz= applies to cron schedules; intervals count from the Unix epoch in UTC")
    else:
        assert cron is not None
        zone = _zone(tz, where)
        try:
            _cronsim().CronSim(cron, datetime.now(zone))
        except _cronsim().CronSimError as exc:
            raise ConfigError(f"{where}: not a cron expression ({exc}); five fields: "
                              "minute hour day-of-month month day-of-week, e.g. '*/5 * * * *'") from None
    label = name if name is not None else kind
    if not isinstance(label, str) or not label.strip() or len(label) > 150:
        raise ConfigError(f"{where}: name= must be a non-empty string of at most 150 characters, got {label!r}")
    return Schedule(label, kind, cron, float(seconds) if seconds is not None else None, zone,
                    dict(payload or {}), missed, float(catch_up), dict(fields))


def enqueue_due(
    queue: _App, engine: Engine, now: datetime | None = None, seen: dict[str, datetime] | None = None
) -> list[Any]:
    """Enqueue each schedule's due slot unless it is already there; returns the jobs inserted.

    One short transaction per schedule. ``seen`` (name -> slot) remembers the
    slots this process has already settled, so it does not ask again.
    """
    now = now or datetime.now(timezone.utc)
    seen = {} if seen is None else seen
    inserted = []
    for schedule in queue.schedules.values():
        slot = schedule.due_slot(now)
        if slot is None or seen.get(schedule.name) == slot:
            continue
        key = schedule.key(slot)
        with Session(engine, expire_on_commit=False) as session, session.begin():
            conn = session.connection()
            if queue.driver(conn).dead_has_key(conn, key):
                seen[schedule.name] = slot
                continue  # the slot ran and used up its attempts: it is done
            result = queue.enqueue_unique(session, schedule.kind, dict(schedule.payload), unique_key=key,
                                          unique_states=SLOT_STATES, **schedule.fields)
        seen[schedule.name] = slot
        if result.inserted:
            log.info("periodic %s: enqueued job %d for %s", schedule.name, result.id, slot.isoformat())
            inserted.append(result.job)
    return inserted


class Scheduler:
    """The thread a worker runs for its app's schedules: enqueue due slots, sleep until the next one."""

    def __init__(self, queue: _App, engine: Engine, clock: Callable[[], datetime] | None = None,
                 prune_after: float | None = None) -> None:
        self.queue = queue
        self.engine = engine
        for schedule in queue.schedules.values():
            if queue.check_kinds and queue.handlers and schedule.kind not in queue.handlers:
                log.error("periodic %s: %s; its slots are refused until one is", schedule.name,
                          queue.unknown_kind_message(schedule.kind))
            if prune_after is not None and schedule.missed == "once" and prune_after < schedule.catch_up:
                # The finished row is what says a slot ran: pruned sooner, a restart could run it twice.
                log.warning("periodic %s: finished jobs are pruned after %gs, sooner than its catch_up of %gs; "
                            "a worker restarted within catch_up of a pruned slot would run it again. Prune later "
                            "or pass catch_up=%g", schedule.name, prune_after, schedule.catch_up, prune_after)
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        self._stop = threading.Event()
        self._seen: dict[str, datetime] = {}
        self._thread = threading.Thread(target=self._main, name="sqla-jobs-periodic", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _main(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                enqueue_due(self.queue, self.engine, self._clock(), self._seen)
                failures = 0
                pause = self._until_next_slot()
            except Exception:
                # A database outage or a handler-less kind: log it, and try again soon (never crash the worker).
                failures += 1
                log.exception("periodic: enqueueing due slots failed (attempt %d); trying again", failures)
                pause = min(MAX_SLEEP, 0.5 * 2 ** min(failures, 6))
            self._stop.wait(pause)

    def _until_next_slot(self) -> float:
        now = self._clock()
        soonest = min(s.next_slot(now) for s in self.queue.schedules.values())
        # A hair after the slot, so the clock read then is past it.
        return max(0.01, min(MAX_SLEEP, (soonest - now).total_seconds() + 0.01))
