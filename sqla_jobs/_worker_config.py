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

import logging
import os
import socket
import uuid
from dataclasses import dataclass, field

from sqlalchemy import Engine

from ._bootstrap import worker_pool_size
from .errors import ConfigError

__all__ = ["WorkerConfig", "check_pool"]

log = logging.getLogger("sqla_jobs.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Every setting of one worker process; see ``Worker`` for what each means."""

    concurrency: int = 4
    queues: tuple[str, ...] | None = None
    lease: float = 60.0
    heartbeat: float | None = None  # None: lease / 3
    poll_interval: float = 1.0
    grace: float = 30.0
    batch_size: int = 100
    flush_interval: float = 0.002
    listen: bool = True
    name: str | None = None  # "{pid}" becomes the process id; None: HOST:PID:RANDOM
    prune_after: float | None = None
    leader: bool = True  # elect one worker for the upkeep (sqla_jobs.leader); False: every worker does it
    # Filled in by __post_init__: the heartbeat actually used and the name with its pid.
    heartbeat_every: float = field(init=False)
    worker_name: str = field(init=False)

    def __post_init__(self) -> None:
        def bad(setting: str, rule: str, value: object) -> ConfigError:
            return ConfigError(f"{setting} must be {rule}, got {value!r}")

        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be at least 1, got {self.concurrency!r}")
        if not self.lease > 0:
            raise bad("lease", "> 0 seconds", self.lease)
        if not self.poll_interval > 0:
            raise bad("poll_interval", "> 0 seconds", self.poll_interval)
        if not self.grace >= 0:
            raise bad("grace", ">= 0 seconds", self.grace)
        if self.batch_size < 1:
            raise bad("batch_size", "at least 1", self.batch_size)
        if not self.flush_interval >= 0:
            raise bad("flush_interval", ">= 0 seconds", self.flush_interval)
        heartbeat = self.heartbeat if self.heartbeat is not None else self.lease / 3
        if not 0 < heartbeat <= self.lease / 3:
            raise ConfigError(f"heartbeat ({heartbeat}s) must be > 0 and at most lease / 3 ({self.lease / 3:g}s)")
        if self.prune_after is not None and not self.prune_after >= 0:
            raise ConfigError("prune_after must be >= 0 seconds (or None to keep finished jobs)")
        if self.queues is not None:
            # A list from a caller is fine; kept as a tuple so the config stays hashable and picklable.
            object.__setattr__(self, "queues", tuple(self.queues) or None)
        object.__setattr__(self, "heartbeat_every", heartbeat)
        name = (self.name.replace("{pid}", str(os.getpid())) if self.name
                else f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}")
        object.__setattr__(self, "worker_name", name)

    @property
    def pool_size(self) -> int:
        """Connections this worker may hold at once: size an engine's pool with it."""
        return worker_pool_size(self.concurrency)


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
        log.warning(
            "worker %s: the engine's pool holds at most %d connections but concurrency %d may need %d "
            "(one per transactional handler, plus the worker's own); handlers would wait for a connection "
            "and fail. Create the engine with create_engine(url, pool_size=%d)",
            config.worker_name, capacity, config.concurrency, needed, needed,
        )
