"""A worker's settings, checked once, in one place.

``WorkerConfig`` is what ``Worker(...)``, ``sqla-jobs worker`` (its options are
the same settings) and ``sqla-jobs bench`` all build, so a bad value gets the same
message whichever way it came, and the pool-sizing rule
(``_bootstrap.worker_pool_size``) is applied to every engine a worker is given:
``check_pool`` warns when the engine's pool cannot hold one connection per
handler thread plus the worker's own, because a transactional handler would then
wait for a connection (30 s by default) and fail.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from sqlalchemy import Engine

from .._bootstrap import worker_pool_size
from ..errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["WorkerConfig", "WorkerSettings", "check_pool", "parse_queue_options", "split_queues", "takes_settings"]

log = logging.getLogger("sqla_jobs.worker")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class WorkerConfig:
    """Every setting of one worker process; see ``Worker`` for what each means.

    ``queue_slots`` (from ``Worker(queues={"default": 8, "emails": 2})`` or
    ``--queue default=8 --queue emails=2``) gives each queue its own handler
    threads: ``concurrency`` is then their sum, ``queues`` their names, and the
    control loop never lets one queue run more jobs than its slots.
    """

    concurrency: int = 4
    queues: tuple[str, ...] | None = None
    queue_slots: tuple[tuple[str, int], ...] | None = None
    lease: float = 60.0
    heartbeat: float | None = None  # None: lease / 3
    poll_interval: float = 1.0
    grace: float = 30.0
    batch_size: int | None = None  # None: as many as the worker has threads (see claim_limit)
    flush_interval: float = 0.002
    listen: bool = True
    name: str | None = None  # "{pid}" becomes the process id; None: HOST:PID:RANDOM
    prune_after: float | None = None
    vacuum_dead_rows: int | None = None  # PostgreSQL: VACUUM the jobs table at this many dead rows
    leader: bool = True  # elect one worker for the upkeep (sqla_jobs.leader); False: every worker does it
    # Filled in by __post_init__: the heartbeat actually used and the name with its pid.
    heartbeat_every: float = field(init=False)
    worker_name: str = field(init=False)

    @classmethod
    def from_settings(cls, **settings: Unpack[WorkerSettings]) -> WorkerConfig:
        """The config of ``Worker(engine, queue, **settings)``: what the caller left out is this class's default."""
        unknown = sorted(settings.keys() - WorkerSettings.__annotations__.keys())
        if unknown:  # as Python says it of any keyword a signature lacks (queue_slots is given as queues={...})
            raise TypeError(f"got an unexpected keyword argument {unknown[0]!r}")
        options: dict[str, Any] = dict(settings)
        concurrency, names, slots = split_queues(options.pop("queues", None), options.pop("concurrency", None))
        return cls(concurrency=concurrency, queues=names, queue_slots=slots, **options)

    @property
    def discards_finished(self) -> bool:
        """``prune_after=0``: a job is deleted as it finishes, in the same statement, not kept to be pruned."""
        return self.prune_after == 0

    def __post_init__(self) -> None:
        def bad(setting: str, rule: str, value: object) -> ConfigError:
            return ConfigError(f"{setting} must be {rule}, got {value!r}")

        if self.queue_slots is not None:
            self._check_slots()  # first: a bad slot count is what to report, not the sum it makes
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {self.concurrency!r}")
        if not self.lease > 0:
            raise bad("lease", "> 0 seconds", self.lease)
        if not self.poll_interval > 0:
            raise bad("poll_interval", "> 0 seconds", self.poll_interval)
        if not self.grace >= 0:
            raise bad("grace", ">= 0 seconds", self.grace)
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or self.batch_size < 1):
            raise bad("batch_size", "at least 1", self.batch_size)
        if not self.flush_interval >= 0:
            raise bad("flush_interval", ">= 0 seconds", self.flush_interval)
        heartbeat = self.heartbeat if self.heartbeat is not None else self.lease / 3
        if not 0 < heartbeat <= self.lease / 3:
            raise ConfigError(f"heartbeat ({heartbeat}s) must be > 0 and at most lease / 3 ({self.lease / 3:g}s)")
        if self.prune_after is not None and not self.prune_after >= 0:
            raise ConfigError("prune_after must be >= 0 seconds (or None to keep finished jobs)")
        if self.vacuum_dead_rows is not None and (
                isinstance(self.vacuum_dead_rows, bool) or not isinstance(self.vacuum_dead_rows, int)
                or self.vacuum_dead_rows < 1):
            raise bad("vacuum_dead_rows", "a whole number >= 1 (or None to leave vacuuming to autovacuum)",
                      self.vacuum_dead_rows)
        if self.queues is not None:
            # A list from a caller is fine; kept as a tuple so the config stays hashable and picklable.
            object.__setattr__(self, "queues", tuple(self.queues) or None)
        object.__setattr__(self, "heartbeat_every", heartbeat)
        name = (self.name.replace("{pid}", str(os.getpid())) if self.name
                else f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}")
        object.__setattr__(self, "worker_name", name)

    def _check_slots(self) -> None:
        slots = tuple((str(name), count) for name, count in self.queue_slots or ())
        if not slots:
            raise ConfigError("queues with slots needs at least one queue, e.g. {'default': 4}")
        for name, count in slots:
            if not name.strip():
                raise ConfigError("a queue name must not be empty")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ConfigError(f"queue {name!r} needs at least 1 slot, got {count!r}")
        names = [name for name, _ in slots]
        if len(set(names)) != len(names):
            raise ConfigError(f"queue {sorted(n for n in names if names.count(n) > 1)[0]!r} is given twice")
        if self.queues is not None and tuple(self.queues) != tuple(names):
            raise ConfigError("give queues either as names or with slots, not both")
        total = sum(count for _, count in slots)
        if self.concurrency != total:
            raise ConfigError(f"concurrency ({self.concurrency}) must be the sum of the queues' slots ({total}) or "
                              "left out: with per-queue slots each queue has its own threads")
        object.__setattr__(self, "queue_slots", slots)
        object.__setattr__(self, "queues", tuple(names))

    @property
    def claim_limit(self) -> int:
        """Most jobs one claim takes, and how many finished runs fill a batch to write at once.

        ``batch_size``, or by default the worker's ``concurrency``: a claim never takes more
        than the threads that are free, so the default caps nothing, and the larger the batch
        the less each job costs the database's round trip (docs/performance.md, "Short jobs").
        """
        return self.concurrency if self.batch_size is None else self.batch_size

    @property
    def slots(self) -> dict[str, int] | None:
        """Handler threads per queue, or None when all queues share ``concurrency``."""
        return dict(self.queue_slots) if self.queue_slots else None

    def summary(self) -> str:
        """The settings a worker's start line gives: ``concurrency 3 (default=2, emails=1), lease 60s``."""
        slots = self.slots
        per_queue = f" ({', '.join(f'{q}={n}' for q, n in slots.items())})" if slots else ""
        deleted = ", finished jobs deleted as they finish" if self.discards_finished else ""
        return f"concurrency {self.concurrency}{per_queue}, lease {self.lease:g}s{deleted}"

    @property
    def pool_size(self) -> int:
        """Connections this worker may hold at once: size an engine's pool with it."""
        return worker_pool_size(self.concurrency)


class WorkerSettings(TypedDict, total=False):
    """The keyword settings of ``Worker(...)`` and ``AsyncWorker(...)``: names and types only. Their defaults
    are ``WorkerConfig``'s fields, and nowhere else (``takes_settings`` shows them in the signature)."""

    concurrency: int | None  # None: WorkerConfig's, or with queues={name: slots} the sum of the slots
    queues: Sequence[str] | Mapping[str, int] | None
    lease: float
    heartbeat: float | None
    poll_interval: float
    grace: float
    batch_size: int | None
    flush_interval: float
    listen: bool
    name: str | None
    prune_after: float | None
    vacuum_dead_rows: int | None
    leader: bool


#: A keyword whose default is not its field's: concurrency=None leaves it to the queues' slots, if any.
_KEYWORD_DEFAULTS: dict[str, Any] = {"concurrency": None}


def takes_settings(function: F) -> F:
    """Spell out ``function``'s ``**settings`` (``WorkerSettings``) with ``WorkerConfig``'s defaults in its
    signature, for ``help()``, ``inspect.signature`` and editors that read them; the call is unchanged."""
    signature = inspect.signature(function)
    head = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    defaults = {f.name: f.default for f in fields(WorkerConfig) if f.init}
    # The module's annotations are strings (ForwardRefs in a TypedDict), as the function's own are.
    settings = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                  annotation=getattr(annotation, "__forward_arg__", annotation),
                                  default=_KEYWORD_DEFAULTS.get(name, defaults[name]))
                for name, annotation in WorkerSettings.__annotations__.items()]
    function.__signature__ = signature.replace(parameters=[*head, *settings])  # type: ignore[attr-defined]
    return function


def check_pool(engine: Engine, config: WorkerConfig) -> None:
    """Warn when ``engine``'s pool cannot hold what a worker with ``config`` may check out at once."""
    pool = engine.pool
    size = getattr(pool, "size", None)
    overflow = getattr(pool, "_max_overflow", None)
    if not callable(size) or not isinstance(overflow, int) or overflow < 0:
        return  # not a bounded QueuePool (NullPool, StaticPool, unlimited overflow): nothing runs short
    capacity = size() + overflow
    needed = config.pool_size
    if capacity < needed:
        factory = "create_async_engine" if engine.dialect.is_async else "create_engine"  # an AsyncEngine's own
        log.warning(
            "worker %s: the engine's pool holds at most %d connections but concurrency %d may need %d "
            "(one per transactional handler, plus the worker's own); handlers would wait for a connection "
            "and fail. Create the engine with %s(url, pool_size=%d)",
            config.worker_name, capacity, config.concurrency, needed, factory, needed,
        )


def split_queues(
    queues: Iterable[str] | Mapping[str, int] | None, concurrency: int | None
) -> tuple[int, tuple[str, ...] | None, tuple[tuple[str, int], ...] | None]:
    """``Worker(queues=..., concurrency=...)`` as (concurrency, names, slots) for ``WorkerConfig``.

    A mapping gives each queue its slots and concurrency defaults to their sum;
    names (or None: every queue) share ``concurrency`` threads (default: ``WorkerConfig``'s).
    """
    if isinstance(queues, str):
        raise ConfigError(f"queues must be a list of names or a mapping of name to slots, not the string {queues!r}")
    if isinstance(queues, Mapping):
        slots = tuple(queues.items())
        total = sum(count for _, count in slots if isinstance(count, int))
        return (total if concurrency is None else concurrency), None, slots
    names = tuple(queues) if queues else None
    return (WorkerConfig.concurrency if concurrency is None else concurrency), names, None


def parse_queue_options(options: list[str]) -> list[str] | dict[str, int]:
    """``--queue`` values: ``NAME`` (queues share ``--concurrency``) or ``NAME=SLOTS`` (each its own threads)."""
    parsed: dict[str, int | None] = {}
    for option in options:
        name, has_slots, raw = option.partition("=")
        name = name.strip()
        if not name:
            raise ConfigError(f"--queue {option!r}: give a queue name, e.g. --queue emails or --queue emails=2")
        if name in parsed:
            raise ConfigError(f"--queue {name!r} is given twice")
        if has_slots:
            try:
                slots = int(raw)
            except ValueError:
                slots = 0
            if slots < 1:
                raise ConfigError(f"--queue {option!r}: SLOTS must be a whole number >= 1, e.g. --queue {name}=2")
            parsed[name] = slots
        else:
            parsed[name] = None
    with_slots = [name for name, slots in parsed.items() if slots is not None]
    if not with_slots:
        return list(parsed)
    if len(with_slots) != len(parsed):
        bare = next(name for name, slots in parsed.items() if slots is None)
        raise ConfigError(f"--queue {bare!r} has no slots while others do: give every queue NAME=SLOTS, or none")
    return {name: slots for name, slots in parsed.items() if slots is not None}
