"""Fair queues: the claim takes jobs round-robin across ``fair_key`` values instead of oldest first.

Declared on the app, per queue::

    queue = JobQueue(Job, DeadJob, fair={"exports": FairQueue(weights={"tenant-big": 3}, key_field="tenant")})
    session.add(Job(kind="export", queue="exports", fair_key="tenant-7", payload={...}))

In a fair queue the worker's claim (``sqla_jobs.drivers._fair``, and PostgreSQL's own statement in
``drivers/postgresql/fair.py``) serves the queue's keys in turn: one due job per key (``w`` with a weight
``w``), then the next key, round after round. Jobs without a key share one turn of their own, so they
neither starve nor starve the keyed ones. A queue not named here is claimed by the plain statement,
unchanged. The key is a column, set at enqueue (``Job(fair_key=...)``) or copied from a top-level
payload field at flush (``key_field``), so that one index, ``ix_<table>_fair`` on
(queue, fair_key, priority, run_at, id) of the pending rows, serves every fair claim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Index, String, text
from sqlalchemy.orm import Mapped, mapped_column, validates

from .drivers import index_dialects_for, partial_where
from .errors import ConfigError, InvalidJob

__all__ = ["MAX_FAIR_KEY_LENGTH", "FairKeyed", "FairQueue", "fair_indexes", "fill_row_key", "keys_for_all", "make_fair"]

MAX_FAIR_KEY_LENGTH = 128
#: A weight's upper bound: a key's turn takes this many jobs at most, so one claim stays small.
MAX_WEIGHT = 100


class FairKeyed:
    """The ``fair_key`` column, mixed into both job tables (a requeued dead job keeps its key)."""

    #: Whose turn the job waits for in a fair queue (a tenant, a customer); NULL: the keyless turn.
    fair_key: Mapped[str | None] = mapped_column(String(MAX_FAIR_KEY_LENGTH), server_default=text("NULL"))

    @validates("fair_key")
    def _check_fair_key(self, key: str, value: Any) -> str | None:
        return check_fair_key(value)


def check_fair_key(value: Any) -> str | None:
    """A key is a non-empty string of at most ``MAX_FAIR_KEY_LENGTH`` characters, or None (no key)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_FAIR_KEY_LENGTH:
        raise InvalidJob(f"Job.fair_key must be a non-empty string of at most {MAX_FAIR_KEY_LENGTH} characters "
                         f"or None, got {value!r}")
    return value


def fair_indexes(name: str) -> list[Index]:
    """The fair claim's index: per queue and key, the pending jobs in claim order. The claim reads it to
    step from one key to the next (one probe per key) and to take a key's most urgent due jobs."""
    return [
        Index(f"ix_{name}_fair", "queue", "fair_key", text("priority DESC"), "run_at", "id",
              **partial_where("state = 'pending'")).ddl_if(dialect=index_dialects_for(partial=True)),
        Index(f"ix_{name}_fair", "state", "queue", "fair_key", text("priority DESC"), "run_at", "id")
        .ddl_if(dialect=index_dialects_for(partial=False)),
    ]


@dataclass(frozen=True)
class FairQueue:
    """How a fair queue shares its turns.

    ``weights``: a key's turns per round (default 1 for every key, and for the keyless turn).
    ``key_field``: a top-level payload field whose value becomes ``fair_key`` at flush when the job
    has none (a number is taken as its text).
    """

    weights: Mapping[str, int] = field(default_factory=dict)
    key_field: str | None = None

    def weight(self, key: str | None) -> int:
        return self.weights.get(key, 1) if key is not None else 1


def make_fair(fair: Mapping[str, FairQueue | Mapping[str, int] | None] | Iterable[str] | None) -> dict[str, FairQueue]:
    """Check ``JobQueue(fair=...)``: queue names, or {queue: FairQueue | weights | None}."""
    if fair is None:
        return {}
    items = fair.items() if isinstance(fair, Mapping) else ((name, None) for name in fair)
    out: dict[str, FairQueue] = {}
    for name, spec in items:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"fair: queue names must be non-empty strings, got {name!r}")
        if spec is None:
            spec = FairQueue()
        elif not isinstance(spec, FairQueue):
            spec = FairQueue(weights=dict(spec))
        for key, w in spec.weights.items():
            check_fair_key(key)
            if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_WEIGHT:
                raise ConfigError(f"fair[{name!r}]: the weight of {key!r} must be a whole number from 1 to "
                                  f"{MAX_WEIGHT}, got {w!r}")
        if spec.key_field is not None and (not isinstance(spec.key_field, str) or not spec.key_field):
            raise ConfigError(f"fair[{name!r}]: key_field must name a top-level payload field")
        out[name] = spec
    return out


def key_filler(fair: Mapping[str, FairQueue]) -> Any:
    """The enqueue check that copies ``key_field`` into ``fair_key`` (None when no queue asks for it)."""
    fields = {name: spec.key_field for name, spec in fair.items() if spec.key_field}
    if not fields:
        return None

    def fill(job: Any) -> None:
        name = fields.get(job.queue or "default")
        if name is None or job.fair_key is not None:
            return
        value = (job.payload or {}).get(name)
        if value is not None and not isinstance(value, bool):
            job.fair_key = check_fair_key(str(value))

    return fill


def fill_row_key(fill: Any, row: dict[str, Any], payload: Any) -> None:
    """An ``enqueue_many`` row without a key gets one from its fair queue's ``key_field`` in ``payload`` (the
    row's, decoded) through ``fill`` (the app's ``key_filler``, None when no queue has one), as a flush does."""
    if fill is not None:
        fill(job := SimpleNamespace(queue=row["queue"], fair_key=row.get("fair_key"), payload=payload))
        if job.fair_key is not None:
            row["fair_key"] = job.fair_key


def keys_for_all(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows``, each with a ``fair_key`` (None: the keyless turn) if any has one: the inserts carry a column
    for all of a call's rows or none."""
    if any("fair_key" in row for row in rows):
        for row in rows:
            row.setdefault("fair_key", None)
    return rows
