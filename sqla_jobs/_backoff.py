"""How long a failed job waits before its next attempt.

The default is the article's schedule: 1, 2, 4, 8, … minutes after the 1st,
2nd, 3rd, 4th failure (the article's own code computes ``2 ** attempts`` after
the claim has already counted the attempt, which starts at 2 minutes; we start
at 1 as its comment says), capped at one hour, with ±10 % jitter so that jobs
that failed together do not all retry in the same second.

Set it per queue or per kind::

    queue = JobQueue(Job, DeadJob, backoff=Backoff(base=5, cap=600))

    @queue.handler("push_crm", backoff=Backoff(base=30, factor=3))
    def push_crm(payload): ...
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: ``min(cap, base * factor ** (failures - 1))``, then jitter."""

    base: float = 60.0
    factor: float = 2.0
    cap: float = 3600.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.base < 0 or self.cap < 0:
            raise ValueError("Backoff base and cap must be >= 0 seconds")
        if self.factor < 1:
            raise ValueError("Backoff factor must be >= 1, or delays would shrink")
        if not 0 <= self.jitter < 1:
            raise ValueError("Backoff jitter must be in [0, 1)")

    def nominal(self, failures: int) -> float:
        """The delay after the ``failures``-th failure, before jitter (failures >= 1)."""
        if failures < 1:
            raise ValueError("failures counts from 1")
        exponent = min(failures - 1, 1000)  # past this, every delay is the cap anyway
        try:
            raw = self.base * self.factor**exponent
        except OverflowError:
            raw = self.cap
        return min(self.cap, raw)

    def delay(self, failures: int, rng: random.Random | None = None) -> float:
        """The delay to use: the nominal one spread by jitter, never above ``cap``."""
        spread = 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return min(self.cap, self.nominal(failures) * spread)
