"""A job's place in its graph, for people: the jobs it depends on and the jobs that depend on it.

``sqla-jobs jobs show`` and the dashboard's job page both show it, in the same
words, from one read (``neighbourhood``); the graph itself is ``sqla_jobs._graph``'s.
A neighbour's ``state`` is the jobs table's, ``dead`` (in the dead letters), or
None: in neither table any more (pruned after it ended, or purged from the dead
letters). When an upstream's failure was passed on to a dependent that ran anyway
(``on_upstream_failure="run"``), the edge between them says how it failed
(``ended``), even if the upstream was requeued and finished since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from .drivers import Driver

__all__ = ["POLICIES", "Neighbour", "Neighbourhood", "SequencePlace", "neighbourhood", "policy_text", "sequence_place"]

#: What a blocked job does when an upstream is dead-lettered, cancelled or purged (``on_upstream_failure``).
POLICIES = {
    "cancel": "this job is cancelled, and so are its own dependents",
    "run": "this job runs anyway, that upstream counted as done (its result reads as None)",
    "wait": "this job waits for a dead-lettered upstream to be requeued (a cancelled or purged one cancels it)",
    "hold": "this job waits for a dead-lettered upstream to be requeued and finish (a cancelled or purged one "
            "counts as done)",
}
_FAILED = {"dead": "was dead-lettered", "cancelled": "was cancelled", "purged": "was purged from the dead letters"}


def policy_text(policy: str | None) -> str:
    """``on_upstream_failure`` in words: ``cancel (the default): if an upstream fails, this job is cancelled, ...``."""
    name = policy or "cancel"
    return f"{name}{' (the default)' if policy is None else ''}: if an upstream fails, {POLICIES.get(name, '?')}"


@dataclass(frozen=True)
class Neighbour:
    """An upstream or a dependent of a job; see the module docstring."""

    id: int
    kind: str | None
    state: str | None
    ended: str | None = None
    #: An upstream of the job shown (else one of its dependents).
    upstream: bool = True

    @property
    def shown_state(self) -> str:
        return self.state or "gone"

    @property
    def note(self) -> str:
        """How it ended, when that is not plain: a failure passed on, dead-lettered, cancelled, gone."""
        if self.ended is not None:
            failed = _FAILED.get(self.ended, self.ended)
            return f"{failed}: counted as done" if self.upstream else f"does without this job, which {failed}"
        if self.state == "dead":
            return "dead-lettered"
        if self.state is None:
            return "no longer in the tables (pruned, or purged from the dead letters)"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "state": self.shown_state, "ended": self.ended}


@dataclass(frozen=True)
class Neighbourhood:
    """A job's upstreams (``depends_on`` order) and dependents (by id), each cut to the limit it was read with;
    the totals count all of them."""

    upstreams: list[Neighbour]
    dependents: list[Neighbour]
    upstream_total: int
    dependent_total: int

    @property
    def more_upstreams(self) -> int:
        return self.upstream_total - len(self.upstreams)

    @property
    def more_dependents(self) -> int:
        return self.dependent_total - len(self.dependents)

    def __bool__(self) -> bool:
        return bool(self.upstream_total or self.dependent_total)


def neighbourhood(driver: Driver, conn: Connection, job_id: int, limit: int | None = None) -> Neighbourhood:
    """Job ``job_id``'s neighbours one step each way, at most ``limit`` of each (None: all of them)."""
    upstream_total, dependent_total = driver.edge_counts(conn, job_id)

    def side(upstream: bool, total: int) -> list[Neighbour]:
        if not total:
            return []
        rows = driver.neighbours(conn, job_id, upstream=upstream, limit=limit)
        return [Neighbour(r.id, r.kind, r.state, r.ended, upstream) for r in rows]

    return Neighbourhood(side(True, upstream_total), side(False, dependent_total), upstream_total, dependent_total)


@dataclass(frozen=True)
class SequencePlace:
    """A job's place in its sequence (``sqla_jobs._sequence``): its key, and the job before it that it waited for
    (``after``; None: none was unfinished when it was enqueued), that job's state as a ``Neighbour``'s, and
    whether it waits for it now."""

    key: str
    after: int | None
    after_state: str | None
    waiting: bool

    def text(self) -> str:
        head = f"sequence {self.key!r}: "
        if self.after is None:
            return head + "first in line (no earlier job of the sequence was unfinished when it was enqueued)"
        state = self.after_state or "gone"
        if not self.waiting:
            return head + f"came after job {self.after} ({state})"
        text = head + f"waits for job {self.after} ({state}) to end"
        if self.after_state == "dead":
            text += (f"; that job is dead-lettered: requeue it (`sqla-jobs dead retry {self.after}`) to go on in "
                     "order, or purge it to let this one run")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "after": self.after, "after_state": self.after_state, "waiting": self.waiting}


def sequence_place(driver: Driver, conn: Connection, job_id: int, key: str | None,
                   state: str) -> SequencePlace | None:
    """Job ``job_id``'s place in sequence ``key`` (None without a key), from its sequence edge."""
    if key is None:
        return None
    row = driver.predecessor(conn, job_id)
    if row is None:
        return SequencePlace(key, None, None, False)
    return SequencePlace(key, int(row.id), row.state, state == "blocked" and row.ended is None)
